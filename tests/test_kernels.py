"""Every Triton kernel against its torch reference on random inputs, several shapes (odd sizes,
Laguna XS.2 shapes scaled down), poisoned outputs; on the CPU through Triton's interpreter."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close, no_host_sync, random
from lucebox.kernels import (
    attention,
    attention_triton,
    gate,
    gate_triton,
    moe,
    moe_triton,
    norm,
    norm_triton,
    quant,
    quant_triton,
    rope,
    rope_triton,
)

from lucebox.config import MoESpec, RopeSpec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 2048 // 16), (3, 5, 24), (2, 130)])
def test_rms_norm_and_fused_residual_add_match_the_reference(poisoned, dtype, shape):
    x, delta = random(*shape, dtype=dtype, seed=1), random(*shape, dtype=dtype, seed=2)
    weight = random(shape[-1], dtype=dtype, seed=3)
    assert_close(norm_triton.rms_norm(x, weight, 1e-6), norm.rms_norm(x.double(), weight.double(), 1e-6), dtype)
    total, normed = norm_triton.add_rms_norm(x, delta, weight, 1e-6)
    want_total, want_normed = norm.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, want_total)  # the sum is rounded exactly as `x + delta` is
    assert_close(normed, norm.rms_norm(want_total.double(), weight.double(), 1e-6), dtype)


ROPES = [
    RopeSpec(kind="default", theta=10000.0, rotary_dim=32),
    RopeSpec(kind="yarn", theta=500000.0, rotary_dim=16, factor=4.0, original_max_position=32),  # partial
    RopeSpec(kind="llama3", theta=10000.0, rotary_dim=24, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position=16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ROPES, ids=lambda s: s.kind)
@pytest.mark.parametrize("T,heads", [(1, 3), (5, 8)])
def test_rope_matches_the_reference(poisoned, dtype, spec, T, heads):
    D = 32
    inv_freq, scaling = rope.inverse_frequencies(spec)
    inv_freq = inv_freq.to(DEVICE)
    x = random(T, heads * D, dtype=dtype, seed=T).view(T, heads, D)  # a view of a projection's output
    positions = torch.tensor([0, 7, 511, 4096, 70000][:T] + list(range(100, 100 + max(0, T - 5))), device=DEVICE)
    (got,) = rope_triton.rotate((x,), positions, inv_freq, scaling)
    (want,) = rope.rotate((x.double(),), positions, inv_freq, scaling)  # angles in float32 in both, as in the model
    assert_close(got, want, dtype)
    assert torch.equal(got[..., spec.rotary_dim:], x[..., spec.rotary_dim:])  # the pass-through features


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per", ["head", "element"])
def test_softplus_gate_matches_the_reference(poisoned, dtype, per):
    T, Hq, D = 3, 6, 24
    out = random(T, Hq, D, dtype=dtype, seed=4)
    logits = random(T, Hq if per == "head" else Hq * D, dtype=dtype, seed=5, scale=8.0)  # reaches |g| > 20
    assert_close(gate_triton.softplus_gate(out, logits), gate.softplus_gate(out.double(), logits.double()), dtype)


def _attention_case(T, Hq, KV, S, D, seed, window=None, pinned=False, all_visible=False, empty=0.2, old=False):
    g = torch.Generator().manual_seed(seed)
    start = S + 3
    q_positions = torch.arange(start, start + T)
    if all_visible:
        k_positions = torch.randperm(S, generator=g)
    else:  # a ring: unordered slots, some empty, the block's own rows among them (causal inside it)
        k_positions = torch.randperm(start + T, generator=g)[:S]
        if old:
            k_positions = torch.randperm(S, generator=g)  # every key older than any window
        k_positions[torch.rand(S, generator=g) < empty] = -1
    pins = (torch.rand(S, generator=g) < 0.3).to(DEVICE) if pinned else None
    return q_positions.to(DEVICE), k_positions.to(DEVICE), pins


ATTENTION_CASES = {
    "decode": dict(T=1, Hq=12, KV=2, S=200, D=32),
    "decode-odd-head-dim": dict(T=1, Hq=3, KV=1, S=77, D=24),
    "verify-16-rows": dict(T=16, Hq=12, KV=2, S=150, D=32),
    "verify-window": dict(T=8, Hq=8, KV=4, S=300, D=16, window=40),
    "prefill-causal": dict(T=70, Hq=4, KV=2, S=90, D=16),
    "prefill-window": dict(T=40, Hq=4, KV=1, S=70, D=16, window=10),
    "select-pinned": dict(T=4, Hq=6, KV=3, S=260, D=16, pinned=True),
    "all-visible": dict(T=3, Hq=4, KV=2, S=64, D=16, all_visible=True),
    "nothing-visible": dict(T=2, Hq=4, KV=2, S=40, D=16, window=4, old=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
@pytest.mark.parametrize("splits", [None, 3])
def test_attention_matches_the_reference(poisoned, dtype, case, splits):
    spec = dict(ATTENTION_CASES[case])
    T, Hq, KV, S, D = (spec.pop(k) for k in ("T", "Hq", "KV", "S", "D"))
    window = spec.get("window")
    q_pos, k_pos, pins = _attention_case(T, Hq, KV, S, D, seed=len(case), **spec)
    q = random(T, Hq, D, dtype=dtype, seed=1)
    k, v = random(KV, S, D, dtype=dtype, seed=2), random(KV, S, D, dtype=dtype, seed=3)
    args = (q_pos, k_pos, 0.3, window, pins, 5, spec.get("all_visible", False))
    out, lse = attention_triton.attention_partial(q, k, v, *args, splits=splits)
    want_out, want_lse = attention.attention_partial(q.double(), k.double(), v.double(), *args)
    if case == "nothing-visible":
        assert torch.isneginf(lse).all() and (out == 0).all()
        return
    assert_close(out, want_out.to(torch.float64), dtype)
    assert torch.allclose(lse.double(), want_lse, atol=1e-3 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_merge_kernel_is_the_log_sum_exp_merge(poisoned, dtype):
    """Splits that saw keys, splits that saw none (lse -inf, their out left as garbage), and rows
    no split saw (zeros and -inf)."""
    splits, T, Hq, D = 4, 3, 4, 24
    out = random(splits, T, Hq, D, seed=5)
    lse = random(splits, T, Hq, seed=6)
    lse[1, 0] = float("-inf")
    out[1, 0] = float("nan")
    lse[:, 2, 1] = float("-inf")
    merged, total = attention_triton.merge_splits(out, lse, dtype)
    want, want_total = attention.merge_stacked(out.nan_to_num(0.0).double(), lse.double())
    assert merged.dtype == dtype
    assert (merged[2, 1] == 0).all() and torch.isneginf(total[2, 1])
    merged[2, 1], want[2, 1] = 1.0, 1.0  # assert_close wants finite, nonzero rows
    assert_close(merged, want, dtype)
    finite = torch.isfinite(want_total)
    assert torch.allclose(total[finite].double(), want_total[finite], atol=1e-5)


def test_attention_partials_merge_with_host_streamed_blocks(poisoned):
    """Split-K partials and separately computed blocks (host chunks) merge into attention over all keys."""
    T, Hq, KV, D = 2, 8, 2, 16
    q = random(T, Hq, D, seed=1)
    keys = [random(KV, n, D, seed=10 + n) for n in (130, 64, 64)]
    values = [random(KV, n, D, seed=20 + n) for n in (130, 64, 64)]
    positions = torch.randperm(258).to(DEVICE).split([130, 64, 64])
    q_pos = torch.tensor([300, 301], device=DEVICE)
    parts = [attention_triton.attention_partial(q, k, v, q_pos, p, 0.25, splits=2)
             for k, v, p in zip(keys, values, positions, strict=True)]
    whole = attention.attention_partial(q.double(), torch.cat(keys, 1).double(), torch.cat(values, 1).double(),
                                        q_pos, torch.cat(positions), 0.25)[0]
    assert_close(attention.merge_partials(parts), whole, torch.float32)


def _experts(E, F, H, dtype, scheme=None, asymmetric=False):
    gate_up = random(E, 2 * F, H, dtype=dtype, seed=7, scale=0.2)
    down = random(E, H, F, dtype=dtype, seed=8, scale=0.2)
    if scheme:
        return tuple(quant.quantize(w, scheme, asymmetric=asymmetric) for w in (gate_up, down))
    return gate_up, down


def _routing(M, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(DEVICE)
    return torch.rand(M, K, generator=g).to(DEVICE), ids


def _dense(w):
    return quant.dequantize(w).double() if isinstance(w, quant.QuantizedTensor) else w.double()


MOE_SHAPES = {  # Laguna XS.2 is hidden 2048, 256 experts of 512, top-8: scaled down, plus odd sizes
    "laguna-scaled": dict(H=64, E=32, F=32, K=8),
    "odd": dict(H=48, E=6, F=40, K=3),
    "few-experts-many-repeats": dict(H=64, E=4, F=32, K=2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=str)
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])  # decode/verify layout up to 16 rows, sorted blocks above
def test_fused_moe_matches_the_reference(poisoned, dtype, shape, M):
    H, E, F, K = (MOE_SHAPES[shape][k] for k in "HEFK")
    gate_up, down = _experts(E, F, H, dtype)
    weights, ids = _routing(M, E, K, seed=M)
    x = random(M, H, dtype=dtype, seed=M)
    want = moe.moe_experts(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    assert_close(moe_triton.moe_experts(x, gate_up, down, weights, ids), want, dtype)


@pytest.mark.parametrize("scheme,asymmetric", [("int8", False), ("int4", False), ("int4", True)])
@pytest.mark.parametrize("M", [1, 16, 33])
def test_fused_moe_takes_quantized_experts(poisoned, scheme, asymmetric, M):
    H, E, F, K = 128, 8, 64, 3
    gate_up, down = _experts(E, F, H, torch.float16, scheme, asymmetric)
    weights, ids = _routing(M, E, K, seed=M)
    x = random(M, H, dtype=torch.float16, seed=M)
    want = moe.moe_experts(x.double(), _dense(gate_up), _dense(down), weights.double(), ids)
    assert_close(moe_triton.moe_experts(x, gate_up, down, weights, ids), want, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("schemes", [(None, None), ("int4", "int8")], ids=["plain", "int4-experts-int8-shared"])
def test_shared_expert_and_routed_scaling_ride_in_the_same_launches(poisoned, dtype, M, schemes):
    """Laguna's layer: routed experts scaled by 2.5 plus a shared expert of another width."""
    H, E, F, K, F_shared = 64, 8, 32, 3, 48
    gate_up, down = _experts(E, F, H, dtype, schemes[0])
    shared_gate_up = random(2 * F_shared, H, dtype=dtype, seed=9, scale=0.2)
    shared_down = random(H, F_shared, dtype=dtype, seed=10, scale=0.2)
    if schemes[1]:
        shared_gate_up, shared_down = (quant.quantize(w, schemes[1]) for w in (shared_gate_up, shared_down))
    weights, ids = _routing(M, E, K, seed=M)
    x = random(M, H, dtype=dtype, seed=M)
    want = moe.moe_experts(x.double(), _dense(gate_up), _dense(down), weights.double(), ids, 2.5,
                           _dense(shared_gate_up), _dense(shared_down))
    got = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, shared_gate_up, shared_down)
    assert_close(got, want, dtype)


@pytest.mark.parametrize("M", [1, 3, 4, 9, 16, 17])
def test_moe_reference_decode_steps_read_no_device_value_and_equal_the_expert_loop(M):
    """Steps of at most 16 rows run without a host read off the CPU: every expert densely once the
    step chooses a pair per expert, else the chosen experts' gathered weights (on the CPU each chosen
    expert in place); each row's result is the expert loop's, whatever its step's other rows."""
    H, E, F, K = 48, 8, 24, 2
    gate_up, down = _experts(E, F, H, torch.float64)
    weights, ids = _routing(M, E, K, seed=M)
    x = random(M, H, dtype=torch.float64, seed=M)
    loop = moe._expert_loop(x, gate_up, down, weights, ids)
    for path in (moe._all_experts, moe._gathered_experts, moe._chosen_experts_in_place):
        torch.testing.assert_close(path(x, gate_up, down, weights, ids), loop, rtol=1e-12, atol=1e-12)
    with no_host_sync() if M <= 16 and x.device.type != "cpu" else nullcontext():
        got = moe.moe_experts(x, gate_up, down, weights, ids)
    one_by_one = torch.cat([moe.moe_experts(x[i : i + 1], gate_up, down, weights[i : i + 1], ids[i : i + 1])
                            for i in range(M)])
    torch.testing.assert_close(got, one_by_one, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, loop, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("M", [2, moe.IN_PLACE_PAIRS, 8, 16])
def test_cpu_verify_steps_give_each_row_its_one_row_bits(M):
    """On the CPU a verify step runs each row's pairs in place (at most `IN_PLACE_PAIRS` pairs) or as
    batched one-row products, so a verified row's MoE output is the plain step's bit for bit in
    float32 (where a GEMM of several rows rounds otherwise than one row's)."""
    H, E, F, K = 256, 8, 64, 2
    gate_up = random(E, 2 * F, H, dtype=torch.float32, seed=7, scale=0.2).cpu()
    down = random(E, H, F, dtype=torch.float32, seed=8, scale=0.2).cpu()
    weights, ids = (t.cpu() for t in _routing(M, E, K, seed=M))
    ids[1] = ids[0]  # two rows sharing their experts: the expert loop would run them as one GEMM
    x = random(M, H, dtype=torch.float32, seed=M).cpu()
    got = moe.moe_experts(x, gate_up, down, weights, ids, 2.5)
    for i in range(M):
        assert torch.equal(got[i : i + 1], moe.moe_experts(x[i : i + 1], gate_up, down, weights[i : i + 1],
                                                           ids[i : i + 1], 2.5)), f"row {i}"


def test_moe_block_table_needs_no_host_sync():
    """The prefill layout's block table is built from device tensors only (CUDA-graph safe)."""
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]], device=DEVICE)
    with no_host_sync():
        order, expert, start, rows = moe_triton._sorted_blocks(ids, num_experts=5, block_m=2, shared_rows=3)
    used = rows > 0
    # Experts 1 and 3 take 3 pairs: two blocks each; then the shared expert's 3 rows (expert -1).
    assert expert[used].tolist() == [0, 1, 1, 2, 3, 3, -1, -1]
    assert rows[used].tolist() == [1, 2, 1, 1, 2, 1, 2, 1]
    assert order[start[-2] :].tolist() == [8, 9, 10]  # shared pairs follow the 8 routed ones
    flat = ids.reshape(-1)
    for b in torch.nonzero(used & (expert >= 0)).flatten().tolist():
        pairs = order[start[b] : start[b] + rows[b]]
        assert (flat[pairs.long()] == expert[b]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme,group,asymmetric", [("int8", None, False), ("int4", 64, False), ("int4", 128, True),
                                                     ("int4", 32, False)])
# The last two stream a long K at decode rows (the GEMV), the 17- and 70-row ones take tl.dot tiles.
@pytest.mark.parametrize("M,N,K", [(1, 70, 256), (3, 64, 128), (17, 33, 384), (70, 96, 128), (1, 40, 1536),
                                   (5, 24, 1024)])
def test_quantized_matmul_matches_the_dequantized_reference(poisoned, dtype, scheme, group, asymmetric, M, N, K):
    w = quant.quantize(random(N, K, dtype=dtype, seed=N), scheme, group, asymmetric)
    x = random(M, K, dtype=dtype, seed=M)
    bias = random(N, dtype=dtype, seed=3)
    want = torch.nn.functional.linear(x.double(), quant.dequantize(w).double(), bias.double())
    assert_close(quant_triton.quantized_linear(x, w, bias), want, dtype)


@pytest.mark.parametrize("scheme,asymmetric", [("int8", False), ("int4", False), ("int4", True)])
def test_quantization_error_is_within_half_a_step(scheme, asymmetric):
    w = random(3, 40, 256, seed=1)  # an expert stack
    q = quant.quantize(w, scheme, asymmetric=asymmetric)
    step = q.scales.float().repeat_interleave(q.group, dim=-1)
    assert ((quant.dequantize(q).float() - w).abs() <= step * 0.5 + 1e-6).all()
    assert q.nbytes() == quant.quantized_bytes(w.shape, scheme) + (q.zeros.numel() * 2 if asymmetric else 0)


def test_routing_is_a_fused_torch_op_without_host_sync():
    """Routing (softmax or sigmoid + bias, top-k, normalization, softcap) stays on the device."""
    spec = MoESpec(num_experts=16, top_k=4, expert_size=8, router="sigmoid", normalize_topk=True,
                   logit_softcap=2.0, correction_bias=True)
    logits, bias = random(5, 16, seed=1), random(16, seed=2)
    with no_host_sync():
        weights, ids = moe.route(logits, spec, bias)
    assert weights.shape == ids.shape == (5, 4)


def test_asymmetric_int4_handles_constant_and_offset_groups():
    """Groups far from zero or constant stay finite and within half a step (integer zero points)."""
    w = torch.cat([torch.full((1, 64), 0.01), 1.0 + torch.rand(1, 64) * 8e-4, torch.randn(1, 64)]).to(DEVICE)
    q = quant.quantize(w, "int4", group=64, asymmetric=True)
    restored = quant.dequantize(q)
    assert torch.isfinite(restored).all()
    step = q.scales.float().repeat_interleave(64, dim=-1)
    assert ((restored - w).abs() <= step * 0.5 + 1e-6).all()
    assert torch.equal(q.zeros, q.zeros.round())
