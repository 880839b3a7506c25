"""docs/architecture.md stays true to the code: every dotted name it gives in backticks resolves to a
module, class, function or attribute; every file it names exists (or is one the code writes); every
code-shaped word it gives (`snake_case`, `CamelCase`) is in the source; and its package map names
every module of lucebox, models and kernels."""

import importlib
import inspect
import pkgutil
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
PACKAGES = ("lucebox", "lucebox.models", "lucebox.kernels")
FILE = re.compile(r"[\w./-]+\.(?:py|json|jinja|safetensors|gguf|model|toml|md|sh)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


@cache
def _modules() -> dict:
    found = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        found[name] = package
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            found[info.name] = importlib.import_module(info.name)
    return found


@cache
def _top_level_names() -> dict[str, list]:
    names: dict[str, list] = {}
    for module in _modules().values():
        for key, value in vars(module).items():
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__.startswith("lucebox"):
                names.setdefault(key, []).append(value)
    return names


@cache
def _source() -> str:
    return "\n".join(p.read_text() for folder in ("lucebox", "models", "kernels", "bench")
                     for p in (ROOT / folder).rglob("*.py"))


def _has(obj, attribute: str) -> bool:
    """A module's or class's attribute, or an instance attribute a class sets (`self.name = ...`)."""
    if hasattr(obj, attribute):
        return True
    if not inspect.isclass(obj):
        return False
    for klass in obj.__mro__:
        if attribute in getattr(klass, "__annotations__", {}):
            return True
        try:
            if re.search(rf"self\.{re.escape(attribute)}\b", inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _resolves(dotted: str) -> bool:
    """`a.b.c`: some module whose name ends with `a.b` (or a class or function named `a`) with the rest as
    attributes, trying the longest module prefix first."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        prefix, rest = ".".join(parts[:cut]), parts[cut:]
        owners = [m for name, m in _modules().items() if name == prefix or name.endswith("." + prefix)]
        owners += _top_level_names().get(prefix, []) if cut == 1 else []
        for owner in owners:
            current = owner
            for attribute in rest:
                if not _has(current, attribute):
                    break
                current = getattr(current, attribute, current)
            else:
                return True
    return False


def _backticked() -> set[str]:
    return {word.rstrip("()") for word in re.findall(r"`([^`\s]+)`", DOC)}


def test_every_dotted_name_resolves():
    names = {w for w in _backticked() if DOTTED.fullmatch(w) and not FILE.fullmatch(w)}
    assert len(names) > 20
    assert sorted(n for n in names if not _resolves(n)) == []


def test_every_file_named_exists_or_is_one_the_code_writes():
    files = {w for w in _backticked() if FILE.fullmatch(w)}
    tree = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if ".git" not in p.parts and ".venv" not in p.parts}
    missing = [f for f in files if not any(t == f or t.endswith("/" + f) for t in tree) and f not in _source()]
    assert sorted(missing) == []


def test_every_code_shaped_word_is_in_the_source():
    words = {w for w in _backticked() if re.fullmatch(r"[A-Za-z_]\w*", w) and ("_" in w or re.search(r"[a-z][A-Z]", w))}
    assert sorted(w for w in words if not re.search(rf"\b{re.escape(w)}\b", _source())) == []


@pytest.mark.parametrize("folder", ["lucebox", "models", "kernels"])
def test_the_package_map_names_every_module(folder):
    def named(stem: str) -> bool:
        return re.search(rf"(?<!\w){re.escape(stem)}(?!\w)", DOC) is not None

    unnamed = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        stem = path.stem
        if stem == "__init__" or (stem.endswith("_triton") and named(stem[: -len("_triton")])):
            continue  # a package, or a Triton kernel beside its named reference
        if not named(stem):
            unnamed.append(str(path.relative_to(ROOT)))
    for package in sorted(p for p in (ROOT / folder).iterdir() if (p / "__init__.py").is_file()):
        if f"{package.name}/" not in DOC:
            unnamed.append(f"{package.relative_to(ROOT)}/")
    assert unnamed == []
