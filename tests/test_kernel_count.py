"""The launch counter behind bench/kernel_count.py (the count itself is checked on the GPU check's
dry run: tests/test_gpu_check.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.benchmark.launches import LaunchCounter


def test_the_counter_counts_kernels_not_views_and_a_triton_launch_once():
    from lucebox.kernels.greedy_triton import greedy_choices

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    counter = LaunchCounter()
    with torch.inference_mode(), counter.counting_triton():  # the engine's mode: F.linear stays one op
        y = F.linear(x, w).view(4, 2).relu()  # one GEMM, one elementwise op, a view
        greedy_choices(y.unsqueeze(0)[0])  # one launch, whatever the interpreter runs inside it
    assert counter.launches == ["aten.linear", "aten.relu", "triton._greedy_kernel"]
