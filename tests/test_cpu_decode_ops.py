"""The CPU decode step's shortcuts do the arithmetic of the paths they stand in for: q and k rotated
in one pass as each alone, bit for bit; rotary tables reused across layers only at equal positions;
torch's RMSNorm op bit for bit the reference's ops; torch's fused attention within float32 rounding of
the reference, rows with nothing visible included; the GPU's MoE decode paths (which the CPU no
longer takes) still read no device value."""

from __future__ import annotations

import torch
from kernel_cases import no_host_sync
from lucebox.kernels import attention, moe, norm, rope

from lucebox.config import RopeSpec


def test_q_and_k_rotated_together_equal_each_rotated_alone():
    inv_freq, scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=10000.0, rotary_dim=16))
    q, k = torch.randn(3, 6, 32), torch.randn(3, 2, 32)  # partial rotary: 16 of 32 features
    positions = torch.tensor([5, 6, 7])
    got = rope.rotate((q, k), positions, inv_freq, scaling)
    want = [rope.rotate((x,), positions, inv_freq, scaling)[0] for x in (q, k)]
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and torch.equal(g, w)


def test_rope_tables_and_roll_are_rotate_half_bit_for_bit():
    """`rope.apply_rope` (x * cos + roll(x) * sin with the table's first half negated) against the
    rotate-half formula the reference implementations write, for full and partial rotary widths."""
    positions = torch.tensor([0, 7, 300])
    for D, rotary in ((32, 32), (32, 16)):
        inv_freq, scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=10000.0, rotary_dim=rotary))
        x = torch.randn(3, 4, D)
        angles = positions.float()[:, None] * inv_freq
        cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
        x_rot, half = x[..., :rotary], rotary // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), -1)
        want = torch.cat((x_rot * cos + rotated * sin, x[..., rotary:]), -1)
        assert torch.equal(rope.apply_rope(x, *rope.cos_sin(positions, inv_freq, scaling, torch.float32)), want)


def test_gpu_moe_decode_paths_read_no_device_value():
    E, F, H = 8, 24, 48
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    x, weights, ids = torch.randn(3, H), torch.rand(3, 2), torch.tensor([[1, 4], [4, 0], [7, 1]])
    with no_host_sync():
        moe._all_experts(x, gate_up, down, weights, ids)
        moe._gathered_experts(x, gate_up, down, weights, ids)


def test_rotary_tables_are_reused_only_at_equal_positions():
    inv_freq, scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=10000.0, rotary_dim=16))
    positions = torch.tensor([5, 6, 7])
    first = rope.step_cos_sin(positions, inv_freq, scaling, torch.float32)
    assert rope.step_cos_sin(positions.clone(), inv_freq, scaling, torch.float32) is first  # the next layer's
    positions += 1  # the same tensor, the next step's positions
    got = rope.step_cos_sin(positions, inv_freq, scaling, torch.float32)
    want = rope.cos_sin(positions, inv_freq, scaling, torch.float32)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not torch.equal(got[0], first[0])
    # Layers alternating two rotary specs (sliding and full theta) each reuse their own tables.
    other, other_scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=500000.0, rotary_dim=16))
    second = rope.step_cos_sin(positions, other, other_scaling, torch.float32)
    assert rope.step_cos_sin(positions, inv_freq, scaling, torch.float32) is got
    assert rope.step_cos_sin(positions, other, other_scaling, torch.float32) is second
    assert not torch.equal(second[0], got[0])
    later = positions + 10
    with torch.inference_mode():  # tables made there are not handed to a pass that trains
        rope.rotate((torch.randn(3, 2, 16),), later, inv_freq, scaling)
    x = torch.randn(3, 2, 16, requires_grad=True)
    rope.rotate((x,), later, inv_freq, scaling)[0].sum().backward()


def test_cpu_rms_norm_is_the_reference_ops_bit_for_bit():
    """`norm.normed_on_cpu` against the reference's ops and torch's own op: the same bits at widths
    that are and are not powers of two (where dividing by the count and multiplying by its inverse
    differ), with one weight per head, in and out of inference mode, and differentiable."""
    for shape, eps in (((1, 256), 1e-6), ((3, 6, 32), 1e-6), ((64, 384), 1e-5), ((64, 40), 1e-6)):
        x, weight = torch.randn(shape), torch.randn(shape[-1])
        want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        assert torch.equal(norm.rms_norm(x, weight, eps), want)
        assert torch.equal(torch.nn.functional.rms_norm(x, weight.shape, weight, eps), want)
        with torch.inference_mode():
            assert torch.equal(norm.rms_norm(x, weight, eps), want)
        x = x.requires_grad_()
        norm.rms_norm(x, weight, eps).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    x, heads = torch.randn(2, 6, 32), torch.randn(6, 32)  # one weight row per head (q's, then k's)
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * heads
    assert torch.equal(norm.normed_on_cpu(x, heads, 1e-6), want)


def test_fused_cpu_attention_matches_the_reference():
    KV, group, D, S = 2, 3, 16, 24
    q, k, v = torch.randn(3, KV * group, D), torch.randn(KV, S, D), torch.randn(KV, S, D)
    k_positions = torch.arange(S)
    k_positions[20:] = -1  # empty slots
    q_positions = torch.tensor([4, 18, 19])
    for window in (None, 8):
        got = attention.attention_partial(q, k, v, q_positions, k_positions, 0.25, window)
        visible = (k_positions[None] <= q_positions[:, None]) & (k_positions[None] >= 0)
        if window is not None:
            visible &= k_positions[None] > q_positions[:, None] - window
        qg = q.view(3, KV, group, D).permute(1, 2, 0, 3).reshape(KV, group * 3, D)
        out, lse = attention._unfused(qg, k, v, visible, 0.25, group)
        torch.testing.assert_close(got[0], out.view(KV, group, 3, D).permute(2, 0, 1, 3).reshape(3, -1, D))
        torch.testing.assert_close(got[1], lse.permute(2, 0, 1).reshape(3, -1))
        for t in range(3):  # a decode step's one row (its mask broadcast over the group's rows)
            one = attention.attention_partial(q[t : t + 1], k, v, q_positions[t : t + 1], k_positions, 0.25, window)
            torch.testing.assert_close(one[0], got[0][t : t + 1])
    # A block whose keys all lie ahead of the first query: that row sees nothing (lse -inf), as the
    # reference gives, so merging it with another block weighs it 0.
    ahead = attention.attention_partial(q, k, v, q_positions, k_positions + 10, 0.25)[1]
    assert torch.isneginf(ahead[0]).all() and torch.isfinite(ahead[1:]).all()


def test_attention_masks_are_shared_across_layers_only_at_equal_positions():
    """The CPU's float32 attention reuses the last mask made for the same window and shapes, only for
    equal positions: a ring's positions change in place from step to step."""
    q, k, v = torch.randn(1, 4, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    k_positions, q_positions = torch.tensor([0, 1, 2, 3, -1, -1]), torch.tensor([3])
    # The third step sees every key without a window (the fused op then runs with no mask).
    for step in range(3):  # each next step: the same tensors, the next positions
        for window in (None, 2, 2):  # the second layer of window 2 takes the first one's mask
            got, lse = attention.attention_partial(q, k, v, q_positions, k_positions, 0.3, window)
            visible = attention._visible(q_positions, k_positions, window, None, 0, None)
            qg = q.view(1, 2, 2, 8).permute(1, 2, 0, 3).reshape(2, 2, 8)
            want, want_lse = attention._unfused(qg, k, v, visible, 0.3, 2)
            torch.testing.assert_close(got, want.view(2, 2, 1, 8).permute(2, 0, 1, 3).reshape(1, 4, 8))
            torch.testing.assert_close(lse, want_lse.view(2, 2, 1).permute(2, 0, 1).reshape(1, 4))
        if step < 2:
            k_positions[step + 4], q_positions[0] = step + 4, step + 4


def test_q_and_k_normed_and_rotated_side_by_side_are_the_separate_ops_bit_for_bit():
    """`rope.norm_rotate_on_cpu` (the CPU's float32 QK norm + RoPE) against `norm.rms_norm` on q and
    on k, then `rope.rotate`: the same bits, at XS.2-like and small widths, one row and a verify block,
    q and k read from one fused projection's output (views with the row stride of q|k|v)."""
    for heads, kv_heads, D, rotary in ((8, 2, 32, 32), (32, 8, 128, 128), (16, 4, 64, 32)):
        inv_freq, scaling = rope.inverse_frequencies(RopeSpec(kind="default", theta=500000.0, rotary_dim=rotary))
        wq, wk = torch.randn(D), torch.randn(D)
        weights = torch.cat((wq.expand(heads, -1), wk.expand(kv_heads, -1)))
        for T in (1, 5):
            out = torch.randn(T, (heads + 2 * kv_heads) * D)
            q = out[:, : heads * D].view(T, heads, D)
            key = out[:, heads * D : (heads + kv_heads) * D].view(T, kv_heads, D)
            positions = torch.arange(100, 100 + T)
            want = rope.rotate((norm.rms_norm(q, wq, 1e-6), norm.rms_norm(key, wk, 1e-6)), positions, inv_freq,
                               scaling)
            got = rope.norm_rotate_on_cpu(q, key, weights, 1e-6, positions, inv_freq, scaling)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
