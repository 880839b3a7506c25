"""The built wheel ships lucebox, lucebox.models and lucebox.kernels, and no top-level models/kernels."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_imports_cleanly(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("lucebox-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"lucebox"}
    assert "lucebox/models/laguna.py" in names and "lucebox/kernels/attention.py" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import lucebox, lucebox.models, lucebox.kernels.moe, lucebox.cli; "
             "print(lucebox.__file__); print(lucebox.models.SUPPORTED_ARCHITECTURES)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith(str(target))
    assert "LagunaForCausalLM" in out
