"""The tree is ruff clean (the style the project holds itself to)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extra; install it to check style")
def test_ruff_is_clean():
    out = subprocess.run(["ruff", "check", str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:]
