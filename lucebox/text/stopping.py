"""Stop strings over streamed text: text is released only once it can no longer be the start of a
stop string, and a stop string itself is never emitted."""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text received but not yet released

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to release, whether a stop string was found)."""
        self.pending += text
        if not self.stops:
            released, self.pending = self.pending, ""
            return released, False
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            released, self.pending = self.pending[: min(hits)], ""
            return released, True
        hold = self._partial_match_length()
        cut = len(self.pending) - hold
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released, False

    def flush(self) -> str:
        released, self.pending = self.pending, ""
        return released

    def _partial_match_length(self) -> int:
        """Length of the longest suffix of `pending` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest
