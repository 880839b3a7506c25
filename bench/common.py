"""What every benchmark records next to its numbers: the machine, the commit, the command."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
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
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def write_result(name: str, payload: dict, directory: Path | str | None = None) -> Path:
    """Write the record under `directory`; by default under bench/results/local/ (not committed), so a
    run never replaces the committed results unless asked to with --out bench/results."""
    directory = Path(directory) if directory else RESULTS / "local"
    directory.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), **payload}
    path = directory / f"{name}-{record['machine'].get('gpu', 'cpu').replace(' ', '_')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
