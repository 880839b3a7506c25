"""The packages import one way: each from its own layer or the layers below it (the layering at the top
of docs/architecture.md), and never in a circle. Every import counts, a function's and a
type-checking one's too: a lazy import is still a dependency.

A node is a package of lucebox (`engine`, `caches`...), one of lucebox's own modules (`errors`,
`llm`...), `lucebox` itself (its `__init__`: the public names), `models` or `kernels`."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
MAPPED = ("models", "kernels")  # top-level folders installed as lucebox.models, lucebox.kernels


def _layers() -> list[list[str]]:
    """The layering block of docs/architecture.md, bottom layer first (an indented line goes on with
    the layer above it)."""
    block = re.search(r"```layers\n(.*?)```", DOC, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    rows: list[list[str]] = []
    for line in block.group(1).splitlines():
        names = line.split("#")[0].split()
        if line.startswith(" "):
            rows[-1] += names
        elif names:
            rows.append(names)
    return rows[::-1]


def _node(module: str) -> str | None:
    """The graph node a dotted module name belongs to, None outside lucebox."""
    parts = module.split(".")
    if parts[0] in MAPPED:
        return parts[0]
    if parts[0] != "lucebox":
        return None
    return parts[1] if len(parts) > 1 else "lucebox"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in MAPPED:
        parts.insert(0, "lucebox")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted modules (or module.name) one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + is_package]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module
    # `from lucebox import errors` imports the module lucebox.errors; `from lucebox import LLM` the package
    return [f"{source}.{alias.name}" if _is_module(f"{source}.{alias.name}") else source for alias in node.names]


def _is_module(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != "lucebox" or len(parts) < 2:
        return False
    folder = ROOT / (parts[1] if parts[1] in MAPPED else Path("lucebox", parts[1]))
    rest = Path(*parts[2:]) if len(parts) > 2 else None
    target = folder / rest if rest else folder
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def import_edges() -> dict[tuple[str, str], str]:
    """(importer node, imported node) -> one file where the importer imports it."""
    edges = {}
    files = [*(ROOT / "lucebox").rglob("*.py"), *(ROOT / "models").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    for path in sorted(files):
        module = _module_name(path)
        source = _node(module)
        for statement in ast.walk(ast.parse(path.read_text())):
            for name in _imported(statement, module, path.name == "__init__.py"):
                target = _node(name)
                if target is not None and target != source:
                    edges.setdefault((source, target), str(path.relative_to(ROOT)))
    return edges


def violations(edges, layers: list[list[str]]) -> list[str]:
    """Each edge that goes up the layering, and each circle of edges within a layer."""
    level = {name: i for i, row in enumerate(layers) for name in row}
    unplaced = sorted({name for edge in edges for name in edge} - set(level))
    assert unplaced == [], f"add {unplaced} to the layering in docs/architecture.md"
    found = [f"{a} -> {b} ({where}): {b} is above {a} in the layering"
             for (a, b), where in sorted(edges.items()) if level[b] > level[a]]
    return found + [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(set(edges))]


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """One circle through each strongly connected group of more than one node."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path = _path_back(graph, start)
        if path:
            cycles.append(path)
            done.update(path)
    return cycles


def _path_back(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A path start -> ... -> start, breadth first, or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    return None


def test_every_package_and_module_is_in_exactly_one_layer():
    named = [name for row in _layers() for name in row]
    assert len(named) == len(set(named)), "a name is in two layers"
    nodes = {name for edge in import_edges() for name in edge}
    nodes |= {_node(_module_name(p)) for p in (ROOT / "lucebox").glob("*.py")}
    nodes |= {p.name for p in (ROOT / "lucebox").iterdir() if (p / "__init__.py").is_file()}
    assert sorted(nodes - set(named)) == [], "add these to the layering in docs/architecture.md"
    assert sorted(set(named) - nodes) == [], "the layering names what no longer exists"


def test_packages_import_only_down_the_layering_and_never_in_a_circle():
    assert violations(import_edges(), _layers()) == []


def test_an_edge_up_or_a_circle_is_found():
    layers, edges = _layers(), import_edges()
    today = set(violations(edges, layers))
    up = {**edges, ("caches", "engine"): "planted"}
    assert "caches -> engine (planted): engine is above caches in the layering" in set(violations(up, layers)) - today
    a, b = layers[0][:2]  # two modules of the bottom layer, importing each other
    circle = {**edges, (a, b): "planted", (b, a): "planted"}
    assert [v for v in set(violations(circle, layers)) - today if v.startswith("import cycle")] != []
