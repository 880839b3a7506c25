"""Cache layers against the plain contiguous cache: same attention after any writes and rollbacks."""

import random

import pytest
import torch
from lucebox.kernels.attention import attention_over_blocks

from lucebox.caches import KVFlashSettings, PagedKV, SlidingRing, Step
from lucebox.caches.contiguous import ContiguousCache

KV, D, HQ = 2, 8, 4
F64 = dict(dtype=torch.float64, device=torch.device("cpu"))


def rows(n, gen):
    return torch.randn(n, KV, D, generator=gen, **{"dtype": torch.float64})


def attend(cache, q, step, window=None):
    return attention_over_blocks(q, step.positions, cache.blocks(q, step), D**-0.5, window)


def run_script(cache, reference, script, window=None, seed=0, length=0):
    """Apply (write n rows | roll back r rows) to both caches, from `length` rows on; after each
    write, attention of the written rows must agree (1e-12, float64)."""
    gen = torch.Generator().manual_seed(seed)
    for op, n in script:
        if op == "rollback":
            length -= n
            cache.rollback(length)
            reference.rollback(length)
            continue
        step = Step(torch.arange(length, length + n))
        k, v = rows(n, gen), rows(n, gen)
        q = torch.randn(n, HQ, D, generator=gen, dtype=torch.float64)
        for c in (cache, reference):
            c.write(step, k, v)
        length += n
        ours, expected = attend(cache, q, step, window), attend(reference, q, step, window)
        assert (ours - expected).abs().max() < 1e-12, f"after {op} {n} at length {length}"
        cache.commit(length - (n // 2))  # drafts: the second half of the rows stays uncommitted
        reference.commit(length - (n // 2))


def random_script(max_step, steps=60, seed=0):
    r = random.Random(seed)
    script = [("write", max_step)]
    for _ in range(steps):
        n = r.randint(1, max_step)
        script.append(("write", n))
        if r.random() < 0.5:
            script.append(("rollback", r.randint(1, n)))
    return script


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window, max_step", [(8, 5), (4, 9)])  # short steps on the second: wrapped windows copied
def test_ring_rollback_never_loses_a_needed_row(seed, window, max_step):
    ring = SlidingRing(window, max_step, KV, D, **F64, windowed=True)
    reference = ContiguousCache(KV, D, 10_000, **F64)
    run_script(ring, reference, random_script(max_step, seed=seed), window=window, seed=seed)


def test_ring_rollback_at_the_wrap_point():
    window, max_step = 8, 4
    ring = SlidingRing(window, max_step, KV, D, **F64, windowed=True)  # 12 slots
    reference = ContiguousCache(KV, D, 100, **F64)
    # Fill to just before the wrap, then write across it, roll back across it, and write again.
    script = [("write", 4), ("write", 4), ("write", 3), ("write", 4), ("rollback", 4), ("write", 4),
              ("write", 4), ("rollback", 3), ("write", 4), ("write", 1), ("rollback", 1), ("write", 4)]
    run_script(ring, reference, script, window=window)


def test_ring_memory_never_grows():
    ring = SlidingRing(8, 4, KV, D, **F64, windowed=True)
    before = ring.device_bytes()
    run_script(ring, ContiguousCache(KV, D, 1000, **F64), [("write", 4)] * 50, window=8)
    assert ring.device_bytes() == before


def test_a_step_reads_only_its_windows_slots_from_a_sliding_layers_ring():
    """A sliding layer's ring (`windowed`) hands a step the rows of positions start - window + 1 ..
    end - 1 alone (a decode step reads a window of keys, not the capacity), in one copy where their
    slots wrap round the ring's end. Rings only bounding what is kept are read whole: a DFlash
    drafter's context and a draft model's full layers (attended with no window). That the attention
    stays exact is `run_script`'s check above."""
    window, max_step = 6, 8
    gen = torch.Generator().manual_seed(0)
    target = SlidingRing(window, max_step, KV, D, **F64, windowed=True)
    kept_only = [SlidingRing(window, max_step, KV, D, **F64, reads_ahead=True),  # a DFlash drafter's
                 SlidingRing(window, max_step, KV, D, **F64)]  # a draft model's full layer
    q = torch.randn(1, HQ, D, dtype=torch.float64)
    wrapped = 0
    for length in range(40):
        step = Step(torch.arange(length, length + 1))
        k, v = rows(1, gen), rows(1, gen)
        for ring in (target, *kept_only):
            ring.write(step, k, v)
        first = max(0, length - window + 1)
        (block,) = target.blocks(q, step)
        assert block.positions.tolist() == list(range(first, length + 1))
        wrapped += first % 14 > length % 14
        for i, position in enumerate(range(first, length + 1)):  # each row's own keys and values
            assert torch.equal(block.k[:, i], target.k[:, position % 14])
            assert torch.equal(block.v[:, i], target.v[:, position % 14])
        for ring in kept_only:
            (whole,) = ring.blocks(q, step)
            assert whole.positions.shape[0] == min(length + 1, 14)
    assert wrapped > 0


def test_a_draft_models_full_layers_read_their_whole_ring(builtin_llm):
    """A draft model keeps its full layers in rings of `draft_ctx` slots but attends over them with
    no window: they are read whole, its sliding layers' rings by their window."""
    from lucebox.caches import SequenceCache
    from lucebox.speculative.draft_model import draft_cache_settings

    cfg = builtin_llm.config
    settings = draft_cache_settings(max_context=256, prefill_chunk=8, draft_ctx=16, max_width=4)
    cache = SequenceCache(cfg, settings, torch.float64, torch.device("cpu"))
    assert [ring.windowed for ring in cache.layers] == [layer.is_sliding for layer in cfg.layers]
    full = next(ring for ring, layer in zip(cache.layers, cfg.layers, strict=True) if not layer.is_sliding)
    kv = torch.zeros(4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    for start in range(0, 40, 4):
        full.write(Step(torch.arange(start, start + 4)), kv, kv)
    (block,) = full.blocks(torch.zeros(1, 1, cfg.head_dim), Step(torch.arange(39, 40)))  # q: not read
    assert block.positions.shape[0] == full.capacity  # 16 + 8 rows: the whole ring, not the last 16


def paged(pool_tokens, max_context, policy="exact", max_step=16):
    settings = KVFlashSettings(policy, pool_tokens, max_context, max_step, decode_rows=16, chunk=8,
                               tail_tokens=32, reselect_every=8, stream_chunks=3)
    return PagedKV(settings, KV, D, **F64)


@pytest.mark.parametrize("seed", range(3))
def test_paged_pool_resident_rollback_matches_reference(seed):
    cache = paged(pool_tokens=512, max_context=512)  # everything fits: no host
    assert cache.residency.host is None
    run_script(cache, ContiguousCache(KV, D, 1000, **F64), random_script(16, steps=25, seed=seed), seed=seed)


@pytest.mark.parametrize("seed", range(3))
def test_paged_offload_rollback_across_chunk_pool_and_host_matches_reference(seed):
    cache = paged(pool_tokens=40, max_context=2048)  # 5 chunks of 8 on the device, the rest on the host
    reference = ContiguousCache(KV, D, 2048, **F64)
    run_script(cache, reference, random_script(16, steps=80, seed=seed), seed=seed)
    assert cache.residency.host is not None and cache.host_bytes() > 0
    resident = {c for c in cache.residency.slot_chunk if c >= 0}
    assert len(resident) <= 5 < -(-cache.length // 8)  # most chunks live only on the host


def test_paged_rollback_into_a_host_resident_chunk():
    cache = paged(pool_tokens=40, max_context=512)
    reference = ContiguousCache(KV, D, 512, **F64)
    # 200 rows, so chunk 3 (positions 24..31) has left the pool; roll back into it and rewrite.
    script = [("write", 16)] * 12 + [("rollback", 16)] * 10 + [("rollback", 4), ("write", 16), ("write", 16)]
    run_script(cache, reference, script)


def test_paged_device_bytes_stay_constant_past_the_pool():
    cache = paged(pool_tokens=40, max_context=4096)
    sizes = []
    gen = torch.Generator().manual_seed(0)
    for start in range(0, 2048, 16):
        step = Step(torch.arange(start, start + 16))
        cache.write(step, rows(16, gen), rows(16, gen))
        cache.commit(start + 16)
        sizes.append(cache.device_bytes())
    assert len(set(sizes)) == 1
    assert cache.host_bytes() >= 2048 * KV * D * 8 * 2


def needle_trial(seed, kind="passage", chunks=48, chunk=16):
    """Random keys, plus one chunk whose keys match the query (all of them: a passage; or a single
    key, strongly); is that chunk chosen, and visible to the next decode step?"""
    gen = torch.Generator().manual_seed(seed)
    settings = KVFlashSettings("select", pool_tokens=12 * chunk, max_context=chunks * chunk + 64, max_step=chunk,
                               decode_rows=16, chunk=chunk, tail_tokens=4 * chunk, reselect_every=chunk)
    cache = PagedKV(settings, KV, D, **F64)
    length = chunks * chunk
    q = torch.randn(HQ, D, generator=gen, dtype=torch.float64)
    needle = int(torch.randint(1, chunks - settings.tail_span - 1, (1,), generator=gen))
    for c in range(chunks):
        k = torch.randn(chunk, KV, D, generator=gen, dtype=torch.float64)
        if c == needle and kind == "passage":  # keys pointing where one query head looks
            k[:, 0, :] = 6.0 * q[0] / q[0].norm() + 0.3 * torch.randn(chunk, D, generator=gen, dtype=torch.float64)
        elif c == needle:
            k[int(torch.randint(chunk, (1,), generator=gen)), 0, :] = 12.0 * q[0] / q[0].norm()
        step = Step(torch.arange(c * chunk, (c + 1) * chunk), prefill=True)
        cache.write(step, k, torch.randn(chunk, KV, D, generator=gen, dtype=torch.float64))
        cache.blocks(q.expand(chunk, HQ, D), step)  # records the step's queries, as a forward does
        cache.commit((c + 1) * chunk)
    decode = Step(torch.tensor([length]))
    cache.write(decode, torch.zeros(1, KV, D, dtype=torch.float64), torch.zeros(1, KV, D, dtype=torch.float64))
    (block,) = list(cache.blocks(q[None], decode))
    visible = block.pinned | (block.positions > length - block.recent)
    needle_seen = bool(visible[(block.positions >= needle * chunk) & (block.positions < (needle + 1) * chunk)].all())
    return needle in cache.selected and needle_seen


@pytest.mark.parametrize("kind", ["passage", "single_key"])
def test_select_retrieves_a_planted_needle_chunk(kind):
    recall = sum(needle_trial(seed, kind) for seed in range(100)) / 100
    print(f"select needle recall ({kind}) over 100 trials: {recall:.2f}")
    assert recall >= 0.95


def test_ring_rewind_is_judged_from_the_highest_row_written():
    ring = SlidingRing(8, 4, KV, D, **F64)  # 12 slots
    gen = torch.Generator().manual_seed(0)
    for start in range(0, 20, 4):
        ring.write(Step(torch.arange(start, start + 4)), rows(4, gen), rows(4, gen))
    ring.rollback(17)  # drafts 17..19 rejected; writing them overwrote the rows of positions 5..7
    assert ring.can_rewind_to(17) and ring.can_rewind_to(15)  # a query at 15 needs positions 8..15: intact
    assert not ring.can_rewind_to(14)  # a query at 14 needs position 7, whose slot position 19 took


def test_ring_rollback_hides_forgotten_rows_from_queries_past_the_rows_written():
    """A DFlash drafter's context ring is read by draft queries at positions it holds no rows for
    yet (`DFlashDrafter.draft`): after a rollback and a shorter rewrite, the rows the rollback
    forgot must be invisible to them, though no write has overwritten their slots: such rings
    read ahead (the target's rings need not: their rollback launches nothing)."""
    ring = SlidingRing(8, 4, KV, D, **F64, reads_ahead=True)  # 12 slots
    reference = ContiguousCache(KV, D, 100, **F64)
    gen = torch.Generator().manual_seed(0)
    for start in range(0, 12, 4):  # the previous request's rows 0..11
        step, k, v = Step(torch.arange(start, start + 4)), rows(4, gen), rows(4, gen)
        for cache in (ring, reference):
            cache.write(step, k, v)
    step, k, v = Step(torch.arange(6, 8)), rows(2, gen), rows(2, gen)
    for cache in (ring, reference):  # rewound to 6, the new request's rows 6, 7
        cache.rollback(6)
        cache.write(step, k, v)
    drafts = Step(torch.arange(8, 12))  # queries at 8..11, attending to rows 0..7 only
    q = torch.randn(4, HQ, D, generator=gen, dtype=torch.float64)
    assert (attend(ring, q, drafts) - attend(reference, q, drafts)).abs().max() < 1e-12


def test_an_emptied_and_refilled_ring_can_be_rewound_to_a_prefix_of_the_new_sequence():
    """A cache reused for a new request is emptied (`rollback(0)`) and refilled: it allows the
    rewinds a fresh ring allows (prefix reuse), and attention after one matches the reference."""
    ring, fresh = SlidingRing(8, 4, KV, D, **F64, windowed=True), SlidingRing(8, 4, KV, D, **F64)  # 12 slots
    gen = torch.Generator().manual_seed(0)
    for start in range(0, 40, 4):  # the previous request, wrapping the ring three times
        ring.write(Step(torch.arange(start, start + 4)), rows(4, gen), rows(4, gen))
    ring.rollback(0)
    reference = ContiguousCache(KV, D, 100, **F64)
    for start in (0, 4):  # the new request: rows 0..7
        step, k, v = Step(torch.arange(start, start + 4)), rows(4, gen), rows(4, gen)
        for cache in (ring, reference, fresh):
            cache.write(step, k, v)
    assert [ring.can_rewind_to(p) for p in range(9)] == [fresh.can_rewind_to(p) for p in range(9)]
    assert ring.can_rewind_to(4)
    step = Step(torch.arange(4, 8))  # the next request shares rows 0..3
    k, v, q = rows(4, gen), rows(4, gen), torch.randn(4, HQ, D, generator=gen, dtype=torch.float64)
    for cache in (ring, reference):
        cache.rollback(4)
        cache.write(step, k, v)
    assert (attend(ring, q, step, 8) - attend(reference, q, step, 8)).abs().max() < 1e-12


def test_rejecting_drafts_launches_nothing_on_the_targets_rings():
    """A speculation round's rollback on the target's sliding rings is host bookkeeping only: the
    rows past the kept ones are rewritten before any query can see them."""
    from lucebox.benchmark.launches import LaunchCounter

    ring = SlidingRing(8, 4, KV, D, **F64)
    gen = torch.Generator().manual_seed(0)
    ring.write(Step(torch.arange(0, 4)), rows(4, gen), rows(4, gen))
    with LaunchCounter() as counter:
        ring.rollback(2)
    assert counter.launches == []


def test_rejecting_drafts_launches_nothing_on_a_paged_pool_and_later_steps_stay_exact():
    """A round's rollback on a full-attention layer's pool is host bookkeeping only, also when the
    drafts opened a chunk; after it, steps that rewrite those positions, and steps that move
    chunks between the pool and the host, attend as the reference does."""
    from lucebox.benchmark.launches import LaunchCounter

    cache = paged(pool_tokens=40, max_context=512)  # 5 chunks of 8 on the device
    reference = ContiguousCache(KV, D, 512, **F64)
    run_script(cache, reference, [("write", 16), ("write", 6)])  # committed 19, rows up to 22
    for c in (cache, reference):  # drafts 19..23 (into chunk 2), all rejected
        c.rollback(19)
    gen = torch.Generator().manual_seed(1)
    step, k, v = Step(torch.arange(19, 24)), rows(5, gen), rows(5, gen)
    for c in (cache, reference):
        c.write(step, k, v)
    with LaunchCounter() as counter:
        cache.rollback(20)
    assert counter.launches == []
    reference.rollback(20)
    # On past the pool: chunks 2.. leave and return, and their slots change hands.
    run_script(cache, reference, [("write", 16)] * 8, seed=2, length=20)
