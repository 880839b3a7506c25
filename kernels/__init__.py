"""Hot-path operators. Each module holds the torch reference of one operator; the Triton versions
(tested against these references) join them, behind one dispatch point."""

import os as _os

if _os.environ.get("TRITON_INTERPRET") == "1":  # the CPU interpreter: patched once per launch
    import importlib.util as _util

    if _util.find_spec("triton") is not None:
        from lucebox.kernels.interpreter import patch_once_per_launch

        patch_once_per_launch()
