"""Caches by kind: every layer cache is a `KVCache` (an attention layer's rows) or a `StateCache` (a
recurrent layer's state) with its own kind's methods only; `SequenceCache` holds each layer's by
kind and never asks which kind a cache is; each KVFlash policy object gives a decode step what
that policy promises (`exact`: every chunk; `select`: the pool, masked to sink, tail and chosen)."""

import re
from pathlib import Path

import pytest
import torch
from test_caches import HQ, KV, D, paged, rows

from lucebox.caches import CacheSettings, KVCache, SequenceCache, StateCache, Step
from lucebox.config import LayerSpec, LinearAttentionSpec, ModelConfig, RopeSpec
from lucebox.errors import CacheRewindError

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
ROPE = RopeSpec(theta=10000.0, rotary_dim=D)
LAYERS = {"gdn": LayerSpec("gdn", HQ, ROPE, "dense"), "sliding": LayerSpec("sliding", HQ, ROPE, "dense", window=8),
          "full": LayerSpec("full", HQ, ROPE, "dense")}
HYBRID = ("gdn", "sliding", "full", "gdn", "full")
KV_METHODS = ("write", "store", "row_table", "blocks", "static_block", "accept_path")
STATE_METHODS = ("step_state", "pin", "returnable", "check_rollback")
# The ways the caches of a sequence are built: the engine's pool (either policy, int8 rows), the
# contiguous reference, a draft model's rings for its full layers.
SETTINGS = {
    "select": CacheSettings.for_engine(4096, 64, "select", 1024),
    "exact-int8": CacheSettings.for_engine(4096, 64, "exact", 1024, kv_int8=True),
    "reference": CacheSettings(512, 64, "exact", 512, reference=True),
    "draft-rings": CacheSettings(512, 64, "exact", 512, full_attention_window=32),
}


def hybrid_cache(settings: CacheSettings = SETTINGS["select"]) -> SequenceCache:
    spec = LinearAttentionSpec(key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4)
    cfg = ModelConfig("test", vocab_size=32, hidden_size=16, num_kv_heads=KV, head_dim=D,
                      layers=tuple(LAYERS[kind] for kind in HYBRID), rms_norm_eps=1e-6, max_position_embeddings=4096,
                      intermediate_size=16, linear_attention=spec)
    return SequenceCache(cfg, settings, torch.float64, CPU)


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_every_layer_cache_is_of_one_kind_with_that_kinds_methods_only(settings):
    cache = hybrid_cache(settings)
    assert sorted(cache.states) == [0, 3] and sorted(cache.kv) == [1, 2, 4]
    for i, layer in enumerate(cache.layers):
        recurrent = HYBRID[i] == "gdn"
        kind, other = (StateCache, KVCache) if recurrent else (KVCache, StateCache)
        own, foreign = (STATE_METHODS, KV_METHODS) if recurrent else (KV_METHODS, STATE_METHODS)
        assert isinstance(layer, kind) and not isinstance(layer, other)
        assert layer is (cache.states if recurrent else cache.kv)[i]
        assert all(hasattr(layer, name) for name in own) and not any(hasattr(layer, name) for name in foreign)


def test_no_code_asks_what_kind_a_cache_is():
    kinds = r"\b(LayerCache|KVCache|StateCache|RecurrentState|PagedKV|SlidingRing|ContiguousCache)\b"
    asking = [f"{path.relative_to(ROOT)}: {line.strip()}"
              for folder in ("lucebox", "models", "kernels") for path in sorted((ROOT / folder).rglob("*.py"))
              for line in path.read_text().splitlines() if "isinstance(" in line and re.search(kinds, line)]
    assert asking == []
    assert "isinstance" not in (ROOT / "lucebox" / "caches" / "sequence.py").read_text()


def forward(cache: SequenceCache, start: int, count: int, gen: torch.Generator, prefill: bool = True) -> None:
    """What a forward does to every layer: K/V rows into the KV caches, states after the rows into the others."""
    step = Step.span(start, count, CPU, prefill=prefill)
    for layer in cache.kv.values():
        layer.write(step, rows(count, gen), rows(count, gen))
    for state in cache.states.values():
        state.reserve(step)
        stepped = state.step_state(step.positions, prefill)
        n = 1 if prefill else count
        stepped.update(*(torch.randn(n, *t.shape[1:], generator=gen, dtype=t.dtype)
                         for t in (state.conv, state.recurrent)))


def test_a_hybrid_sequence_cache_serves_each_kind_by_its_contract():
    cache, gen = hybrid_cache(), torch.Generator().manual_seed(0)
    assert cache.has_states
    forward(cache, 0, 40, gen)
    cache.commit(40)
    cache.pin(40)
    forward(cache, 40, 30, gen)
    cache.commit(70)
    assert cache.rewind_point(60) == 40  # the pinned state: every KV cache can return there too
    with pytest.raises(CacheRewindError):
        cache.rollback(60)  # refused before any layer moved
    assert not cache.dirty and cache.kv[2].length == 70
    with pytest.raises(NotImplementedError, match="draft trees"):
        cache.accept_path(69, [1])
    assert not cache.dirty
    cache.rollback(40)
    assert cache.length == 40 and cache.can_rewind_to(40) and cache.memory()["recurrent_states"] > 0


def select_and_exact(policy: str):
    """A pool of 12 chunks of 8 (select: 3 chosen) over 200 committed rows, most chunks on the host,
    then a decode step's row written at 200; the step and its query."""
    cache, gen = paged(pool_tokens=96, max_context=2048, policy=policy), torch.Generator().manual_seed(3)
    for start in range(0, 200, 8):
        step = Step(torch.arange(start, start + 8), prefill=True)
        cache.write(step, rows(8, gen), rows(8, gen))
        cache.blocks(torch.randn(8, HQ, D, generator=gen, dtype=torch.float64), step)  # keeps the queries
        cache.commit(start + 8)
    decode = Step(torch.tensor([200]))
    cache.write(decode, rows(1, gen), rows(1, gen))
    return cache, decode, torch.randn(1, HQ, D, generator=gen, dtype=torch.float64)


def test_exact_attends_every_chunk_streaming_those_on_the_host():
    cache, decode, q = select_and_exact("exact")
    blocks = list(cache.blocks(q, decode))
    seen = torch.cat([b.positions[b.positions >= 0] for b in blocks]).sort().values
    assert len(blocks) > 1 and torch.equal(seen, torch.arange(201))  # each row once: the pool's, then the host's
    assert all(b.pinned is None for b in blocks) and not cache.graphable(decode)  # chunks on the host
    assert cache.selected == [] and cache.rows_before_reselect(203) is None and cache.summary_bytes() == 0


def test_select_attends_the_pool_masked_to_sink_tail_and_the_chosen_chunks():
    cache, decode, q = select_and_exact("select")
    (block,) = cache.blocks(q, decode)
    assert len(cache.selected) == cache.s.select_k == 3 and block.recent == cache.s.tail_tokens
    pinned_chunks = set((block.positions[block.pinned] // 8).tolist())
    assert pinned_chunks == {0, *cache.selected}  # every pinned row is of the sink or a chosen chunk
    static = cache.static_block(q)
    assert cache.graphable(decode) and static.pinned is cache.static_block(q).pinned  # one address for a graph
    assert torch.equal(static.pinned[: len(block.pinned)], block.pinned)
    assert cache.rows_before_reselect(203) == 5 and cache.summary_bytes() > 0
