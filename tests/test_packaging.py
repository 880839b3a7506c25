"""The built wheel ships lucebox, lucebox.models and lucebox.kernels (and the built-in model's files),
and no top-level models/kernels."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_imports_cleanly(tmp_path):
    # Build from a clean copy: setuptools reuses a build/ folder, which could hide a missing package.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("build", ".venv", ".git", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("lucebox-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"lucebox"}
    assert "lucebox/models/laguna.py" in names and "lucebox/kernels/attention.py" in names
    # the built-in model and its drafter are package data: every file of the folder is in the wheel
    builtin = ROOT / "lucebox" / "data" / "laguna-code-6m"
    shipped = {"lucebox/" + str(f.relative_to(ROOT / "lucebox")) for f in builtin.rglob("*") if f.is_file()}
    assert len(shipped) >= 7 and shipped <= set(names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    # Every package of the source tree is in the wheel (a missing one would import from the
    # source tree here, through the editable install, and hide the gap).
    packages = {str(p.parent.relative_to(ROOT)) for d in ("lucebox", "models", "kernels")
                for p in (ROOT / d).rglob("__init__.py")}
    mapped = {p.replace("models", "lucebox/models", 1).replace("kernels", "lucebox/kernels", 1)
              if not p.startswith("lucebox") else p for p in packages}
    assert {m + "/__init__.py" for m in mapped} <= set(names)
    probe = ("import importlib, pkgutil, lucebox; "
             "mods = [importlib.import_module(m.name) for m in pkgutil.walk_packages(lucebox.__path__, 'lucebox.')]; "
             "print(lucebox.__file__); print(sorted({m.__file__.split('/lucebox/')[0] for m in mods}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert out[1] == repr([str(target)])  # every submodule came from the installed wheel


def test_a_plain_checkout_imports_models_and_kernels_under_lucebox():
    """With only the repository root on the path (no install: `-S` skips the editable install's
    finder), `lucebox.models` and `lucebox.kernels` come from the top-level folders."""
    import torch

    site = Path(torch.__file__).resolve().parents[1]  # torch and the other dependencies, without .pth files
    probe = ("import lucebox.models.decoder, lucebox.kernels.moe; "
             "print(lucebox.models.decoder.__file__); print(lucebox.kernels.moe.__file__)")
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd="/", env={"PYTHONPATH": f"{ROOT}:{site}"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [str(ROOT / "models" / "decoder.py"), str(ROOT / "kernels" / "moe.py")]
