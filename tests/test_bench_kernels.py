"""`bench/kernels.py --dry-run` runs every kernel benchmark and the whole-model decode on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_benchmark_dry_run_writes_every_measurement(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/kernels.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "kernels-cpu.json").read_text())
    assert result["dry_run"] and result["peak_gb_per_s"] > 0 and result["commit"] and result["command"]
    for section in ("moe", "attention", "linear", "small"):
        assert {row["M"] for row in result[section]} == {1, 8}, section
        assert all(row["us"] > 0 and row["gb_per_s"] > 0 for row in result[section]), section
    assert {row["weights"] for row in result["moe"]} == {"float32", "int4"}
    assert {row["layer"] for row in result["attention"]} == {"full", "sliding"}
    assert {row["weights"] for row in result["linear"]} == {"float32", "int8", "int4"}
    assert [row["weights"] for row in result["model"]] == ["float32", "int4"]
    assert all(row["decode_tokens_per_s"] > 0 and row["bytes_per_token"] > 0 for row in result["model"])
    assert len(result["targets"]) >= 5
