"""`lucebox bench`: the long-context benchmark runner (one row per context depth)."""
