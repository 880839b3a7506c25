"""What every benchmark result records beside its numbers: the machine, the commit, the date.

`bench/*.py` and `lucebox bench` both use these, so every result file describes its run the same way.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import torch

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding lucebox/, when it is one


def machine() -> dict:
    """CPU, memory, Python and torch versions, and the GPU's name when CUDA is available."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
    """The checkout's commit (+ "-dirty" with uncommitted changes to tracked files), or "unknown" for
    an installed package: site-packages may sit inside some other repository, so the repository's
    top level must be the folder that holds lucebox/."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != PACKAGE_ROOT:
        return "unknown"
    sha = _git("rev-parse", "HEAD")
    if not sha:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return sha + ("-dirty" if dirty else "")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
