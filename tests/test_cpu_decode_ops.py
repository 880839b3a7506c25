"""The CPU decode step's shortcuts do the arithmetic of the paths they stand in for: q and k rotated
in one pass as each alone, bit for bit; the GPU's MoE decode paths (which the CPU no longer takes)
still read no device value."""

from __future__ import annotations

import torch
from kernel_cases import no_host_sync
from lucebox.kernels import moe, rope

from lucebox.config import RopeSpec


def test_q_and_k_rotated_together_equal_each_rotated_alone():
    inv_freq, scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=10000.0, rotary_dim=16))
    q, k = torch.randn(3, 6, 32), torch.randn(3, 2, 32)  # partial rotary: 16 of 32 features
    positions = torch.tensor([5, 6, 7])
    got = rope.rotate((q, k), positions, inv_freq, scaling)
    want = [rope.rotate((x,), positions, inv_freq, scaling)[0] for x in (q, k)]
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and torch.equal(g, w)


def test_gpu_moe_decode_paths_read_no_device_value():
    E, F, H = 8, 24, 48
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    x, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.tensor([[1, 4], [4, 0], [7, 1]])
    with no_host_sync():
        moe._all_experts(x, gate_up, down, weights, ids)
        moe._gathered_experts(x, gate_up, down, weights, ids)
