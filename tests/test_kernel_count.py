"""Kernels per decoded token of the graphed step at Laguna XS.2's layer pattern (every ATen kernel
and Triton launch of the step body, views excluded): each launch is a dependent node of the CUDA
graph, ~2 us on a consumer GPU, so launches per layer decide whether a step can reach the
bandwidth roofline (issue 25: at most 12 per layer, 500 per token; ~1,800 before)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from lucebox.benchmark.launches import LaunchCounter

ROOT = Path(__file__).resolve().parents[1]


def test_the_counter_counts_kernels_not_views_and_a_triton_launch_once():
    from lucebox.kernels.greedy_triton import greedy_choices

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    counter = LaunchCounter()
    with torch.inference_mode(), counter.counting_triton():  # the engine's mode: F.linear stays one op
        y = F.linear(x, w).view(4, 2).relu()  # one GEMM, one elementwise op, a view
        greedy_choices(y.unsqueeze(0)[0])  # one launch, whatever the interpreter runs inside it
    assert counter.launches == ["aten.linear", "aten.relu", "triton._greedy_kernel"]


def test_the_graphed_step_at_the_xs2_pattern_launches_at_most_12_kernels_per_layer(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/kernel_count.py", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = tmp_path.glob("kernel-count-*.json")
    result = json.loads(path.read_text())
    assert set(result["launches_per_layer"]) == {"full+dense", "sliding+moe", "full+moe"}
    assert result["xs2_layers_per_kind"] == {"full+dense": 1, "sliding+moe": 30, "full+moe": 9}
    assert result["most_per_layer"] <= 12, result["ops_per_kind"]
    assert result["launches_per_token_xs2"] <= 500
    assert sum(result["head"].values()) <= 2, result["head"]  # LM head + greedy choice
