"""The attention half of a graphed decode step in few launches: q/k norm, RoPE and the K/V store
as one operator over a cache's `RowTable`, and q, k, v (and the gate) as one projection."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch
from kernel_cases import DEVICE, assert_close, random
from lucebox.kernels import attention, attention_triton, rope, rope_store, rope_store_triton
from lucebox.kernels.gate import softplus_gate
from lucebox.kernels.norm import rms_norm
from lucebox.kernels.quant import QuantizedTensor

import lucebox
from lucebox.caches import KVFlashSettings, PagedKV, SlidingRing, Step
from lucebox.config import RopeSpec
from lucebox.engine.runner import StepRunner

KV, HQ, D = 2, 4, 32
ROPES = [RopeSpec(kind="default", theta=10000.0, rotary_dim=32),
         RopeSpec(kind="yarn", theta=500000.0, rotary_dim=16, factor=4.0, original_max_position=32)]  # partial
# (rope positions, row positions) of a step: a chain crossing the ring's wrap (capacity 8) and a
# paged chunk boundary (chunk 8), and a tree whose rows sit at scratch positions past their depths.
STEPS = {"chain": ([6, 7, 8], [6, 7, 8]), "tree": ([6, 7, 7], [6, 7, 8])}


def _cache(kind: str, dtype: torch.dtype):
    """A ring or a paged pool reserved for rows at positions 6..8, with written rows to overwrite."""
    if kind == "ring":
        cache = SlidingRing(5, 3, KV, D, dtype, DEVICE, windowed=True)  # capacity 8: position 8 goes to slot 0
    else:
        settings = KVFlashSettings("exact", pool_tokens=32, max_context=64, max_step=8, decode_rows=4, chunk=8,
                                   tail_tokens=16, reselect_every=8, stream_chunks=2)
        cache = PagedKV(settings, KV, D, dtype, DEVICE)
    for start in (0, 3):
        cache.write(Step.span(start, 3, DEVICE), random(3, KV, D, dtype=dtype, seed=start),
                    random(3, KV, D, dtype=dtype, seed=start + 1))
    cache.reserve(Step.span(6, 3, DEVICE))
    if kind == "paged":  # chunks in slots other than their own number, so the table matters
        cache.residency.page_table[:2] = torch.tensor([3, 1], device=DEVICE)
    return cache


def _planes(cache) -> list[torch.Tensor]:
    rows = cache.row_table()
    return [rows.k, rows.v, rows.positions]


def _inputs(dtype: torch.dtype, spec: RopeSpec, step: str, qk_norm: bool):
    T = 3
    projected = random(T, (HQ + 2 * KV) * D, dtype=dtype, seed=1)  # q, k, v as views of one projection
    q, key, value = (projected[:, a * D : b * D].view(T, -1, D) for a, b in ((0, HQ), (HQ, HQ + KV),
                                                                             (HQ + KV, HQ + 2 * KV)))
    inv_freq, scaling = rope.inverse_frequencies(spec)
    norms = (random(D, dtype=dtype, seed=2), random(D, dtype=dtype, seed=3)) if qk_norm else None
    positions, row_positions = (torch.tensor(p, device=DEVICE) for p in STEPS[step])
    return q, key, value, positions, inv_freq.to(DEVICE), scaling, norms, 1e-6, row_positions


@pytest.mark.parametrize("kind", ["ring", "paged"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_store_puts_rows_where_the_cache_store_does(kind, step, qk_norm):
    """The reference over `row_table()` leaves the cache as the unfused path (norm, rotate, `store`) does."""
    fused, unfused = _cache(kind, torch.float64), _cache(kind, torch.float64)
    q, key, value, positions, inv_freq, scaling, norms, eps, row_positions = _inputs(torch.float64, ROPES[1], step,
                                                                                     qk_norm)
    got = rope_store.norm_rope_store(q, key, value, positions, inv_freq, scaling, norms, eps, fused.row_table(),
                                     row_positions)
    if norms is not None:
        q, key = (rms_norm(x, w, eps) for x, w in zip((q, key), norms, strict=True))
    want, key = rope.rotate((q, key), positions, inv_freq, scaling)
    unfused.store(row_positions, key, value)
    assert torch.allclose(got, want)
    for a, b in zip(_planes(fused), _planes(unfused), strict=True):
        assert torch.equal(a, b)
    assert set(fused.row_table().positions.tolist()) >= set(STEPS[step][1])


@pytest.mark.parametrize("kind", ["ring", "paged"])
@pytest.mark.parametrize("spec", ROPES, ids=lambda s: s.kind)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_norm_rope_store_matches_the_reference(poisoned, kind, spec, qk_norm, dtype):
    args = _inputs(dtype, spec, "tree", qk_norm)
    triton_cache, torch_cache = _cache(kind, dtype), _cache(kind, dtype)
    got = rope_store_triton.norm_rope_store(*args[:-1], triton_cache.row_table(), args[-1])
    want = rope_store.norm_rope_store(*args[:-1], torch_cache.row_table(), args[-1])
    assert_close(got, want, dtype)
    k, v, positions = _planes(triton_cache)
    want_k, want_v, want_positions = _planes(torch_cache)
    assert_close(k, want_k, dtype)
    assert_close(v, want_v, dtype)
    assert torch.equal(positions, want_positions)


def test_int8_pools_keep_the_unfused_store():
    settings = KVFlashSettings("exact", pool_tokens=32, max_context=32, max_step=8, decode_rows=4, chunk=8,
                               tail_tokens=16, reselect_every=8, stream_chunks=2)
    assert PagedKV(settings, KV, D, torch.float32, DEVICE, int8=True).row_table() is None


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_attention_projections_load_as_one_weight_whose_rows_are_the_originals(reference_models, quantization):
    """Laguna (q, k, v and the softplus gate's wg): one fused weight, the originals views of its
    rows, so the bytes are held once."""
    folder, _ = reference_models("laguna")
    w = lucebox.LLM(folder, device="cpu", dtype="float32", quantization=quantization).engine.decoder.w
    fused, parts = w["layers.0.wqkv"], [w[f"layers.0.{n}"] for n in ("wq", "wk", "wv", "wg")]
    codes = (lambda t: t.codes) if quantization else (lambda t: t)
    assert isinstance(fused, QuantizedTensor) == (quantization is not None)
    assert torch.equal(codes(fused), torch.cat([codes(p) for p in parts]))
    assert all(codes(p).untyped_storage().data_ptr() == codes(fused).untyped_storage().data_ptr() for p in parts)


def test_a_fused_bias_stays_beside_its_rows_when_a_part_has_none():
    """q and v with biases, k without (as some checkpoints have): k's rows get zeros, v's bias its own rows."""
    from types import SimpleNamespace

    from lucebox.models.fused_projections import fuse_attention_projections

    w = {f"layers.0.{n}": random(rows, 3, seed=rows) for n, rows in (("wq", 4), ("wk", 2), ("wv", 2))}
    bq, bv = random(4, seed=7), random(2, seed=8)
    w.update({"layers.0.bq": bq.clone(), "layers.0.bv": bv.clone()})
    fuse_attention_projections(SimpleNamespace(layers=[SimpleNamespace(attention="full")], latent_attention=None), w)
    assert torch.equal(w["layers.0.bqkv"], torch.cat([bq, torch.zeros(2, device=bq.device), bv]))
    assert torch.equal(w["layers.0.bv"], bv) and torch.equal(w["layers.0.bq"], bq)


@pytest.mark.parametrize("per", ["head", "element"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softplus_gate_rides_in_the_attention_merge(poisoned, per, splits, dtype):
    """Attention with `gate` (logits a view of the fused projection's output, as the mixer hands
    them) equals the reference's attention followed by the softplus gate, one split or several."""
    T, S = 2, 200
    q = random(T, HQ, D, dtype=dtype, seed=4)
    k, v = random(KV, S, D, dtype=dtype, seed=5), random(KV, S, D, dtype=dtype, seed=6)
    positions = torch.arange(S, device=DEVICE)
    positions[150:] = -1  # empty slots
    width = HQ if per == "head" else HQ * D
    gate = random(T, width + 8, dtype=dtype, seed=7)[:, 8:]
    got, got_lse = attention_triton.attention_partial(q, k, v, positions[[140, 149]], positions, D**-0.5, 100,
                                                      splits=splits, gate=gate)
    want, want_lse = attention.attention_partial(q.double(), k.double(), v.double(), positions[[140, 149]],
                                                 positions, D**-0.5, 100)
    assert_close(got, softplus_gate(want, gate.double()), dtype)
    assert_close(got_lse, want_lse, torch.float32)


def test_the_graphed_decode_step_runs_the_attention_half_in_few_operators(reference_models):
    """Per Laguna attention layer: one projection (the fused weight), one norm + RoPE + store, one
    attention with the gate inside; no separate rotate, QK norm or gate."""
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32")
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    cache = llm.engine.new_cache()
    prompt = list(range(3, 40))
    for _ in llm.engine.prefill(prompt, cache):
        pass
    calls, w = defaultdict(list), llm.engine.decoder.w

    def spied(name, real):
        def spy(*args, **kwargs):
            calls[name].append(args)
            return real(*args, **kwargs)
        return spy

    table = llm.engine.decoder.kernels
    names = ("linear", "rotate", "rms_norm", "softplus_gate", "norm_rope_store", "attention_partial")
    llm.engine.decoder.kernels = dataclasses.replace(table, **{n: spied(n, getattr(table, n)) for n in names})
    llm.engine.runner.step([5], Step.span(len(prompt), 1, llm.device), cache)
    layers = len(llm.config.layers)
    fused = {id(w[f"layers.{i}.wqkv"]) for i in range(layers)}
    parts = {id(w[f"layers.{i}.{n}"]) for i in range(layers) for n in ("wq", "wk", "wv", "wg")}
    assert sum(id(args[1]) in fused for args in calls["linear"]) == layers
    assert not any(id(args[1]) in parts for args in calls["linear"])
    assert len(calls["norm_rope_store"]) == len(calls["attention_partial"]) == layers
    assert not calls["rotate"] and not calls["softplus_gate"]
    assert len(calls["rms_norm"]) <= 1  # the first layer's input norm; QK norms ride in norm_rope_store


@pytest.mark.parametrize("newest", [50, 130, 223])  # before the window fills, wrapped, wrapped twice
@pytest.mark.parametrize("tree", [False, True])
def test_ring_attention_splits_share_the_live_window(poisoned, newest, tree):
    """A sliding ring's graphed attention splits only the window + T slots that can hold visible
    keys, found from the query positions, wherever the ring has wrapped: the same result as
    attention over the whole ring."""
    window, S, T = 100, 112, 3
    positions = torch.full((S,), -1, device=DEVICE)
    for p in range(newest + 1):  # what the ring holds after writing positions 0..newest
        positions[p % S] = p
    q = random(T, HQ, D, seed=10)
    k, v = random(KV, S, D, seed=11), random(KV, S, D, seed=12)
    start = newest - T + 1
    q_positions = torch.tensor([start, start + 1, start + 1] if tree else list(range(start, newest + 1)),
                               device=DEVICE)
    bits = {"tree_bits": torch.tensor([1, 3, 5], device=DEVICE)} if tree else {}
    got, got_lse = attention_triton.attention_partial(q, k, v, q_positions, positions, D**-0.5, window, splits=2,
                                                      ring=True, **bits)
    want, want_lse = attention.attention_partial(q.double(), k.double(), v.double(), q_positions, positions,
                                                 D**-0.5, window, **bits)
    assert_close(got, want, torch.float32)
    assert_close(got_lse, want_lse, torch.float32)
