"""`lucebox.models` and `lucebox.kernels` live in the top-level `models/` and `kernels/` folders,
which pyproject's `package-dir` maps into the package when it is installed. A plain checkout (no
install, just the repository root on `sys.path`) gets the same mapping here, without symlinks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_MAPPED = ("models", "kernels")


class _CheckoutFinder:
    """Finds `lucebox.models` and `lucebox.kernels` in the checkout's own folders; consulted only
    after every other finder (an installed or editable lucebox finds them first)."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        package = name.removeprefix("lucebox.")
        if package not in _MAPPED or name == package:
            return None
        folder = self.root / package
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def map_checkout_packages() -> None:
    root = Path(__file__).resolve().parent.parent
    in_checkout = (root / "pyproject.toml").is_file() and all((root / p / "__init__.py").is_file() for p in _MAPPED)
    if in_checkout and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder(root))
