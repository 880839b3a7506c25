"""The tree is ruff clean (the style the project holds itself to)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the test extra")
def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]


def test_functions_and_files_stay_small():
    """No function in the package over 60 lines (Triton kernels aside: one kernel is one launch),
    no file over 300 lines."""
    import ast

    long = []
    for folder in ("lucebox", "models", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(ROOT)
            if text.count("\n") > 300:
                long.append(f"{name}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    if not any("jit" in ast.unparse(d) for d in node.decorator_list):
                        long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []
