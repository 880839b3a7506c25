"""The long-context host path: prefill attention's memory stays one block's whatever the context
(and within the planner's figure, at Laguna XS.2's widths), host K/V is one arena of the planned
size, a KVFlash re-selection runs a fixed number of operations per layer however many chunks it
loads, and none runs during a prompt's prefill chunks."""

import gc
import weakref

import pytest
import torch
from conftest import EXAMPLES
from lucebox.kernels.attention import attention_over_blocks, merge_partials, merge_stacked
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lucebox
from lucebox.caches import CacheSettings, KVBlock, KVFlashSettings, PagedKV, SequenceCache, Step, host_arena
from lucebox.caches.chunk_selection import ChunkSelection
from lucebox.caches.host_arena import HostArena
from lucebox.checkpoints.loading import describe_model
from lucebox.memory.plan import plan
from lucebox.memory.vram import merge_bytes

XS2 = describe_model(EXAMPLES / "laguna-xs2").cfg


class LiveBytes(TorchDispatchMode):
    """The peak of bytes held by tensors the ops under it allocate (views and in-place results
    count no new bytes; tensors made before it, none)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data pointer -> [bytes, live tensors on it]
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return result

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        pointer = t.untyped_storage().data_ptr()
        if pointer not in self.storages:
            if pointer in inputs or not t.untyped_storage().nbytes():
                return  # a view or in-place result of memory made before
            self.storages[pointer] = [t.untyped_storage().nbytes(), 0]
            self.live += self.storages[pointer][0]
            self.peak = max(self.peak, self.live)
        self.storages[pointer][1] += 1
        weakref.finalize(t, self._release, pointer)

    def _release(self, pointer: int) -> None:
        entry = self.storages[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[pointer]


def prefill_attention_peak(blocks: int, rows: int = 2048, keys: int = 64) -> int:
    """Peak bytes of one full-attention layer's prefill attention at XS.2's widths (float32 on the
    CPU) over `blocks` key blocks streamed one at a time, as a long context's are."""
    layer = XS2.layers[0]
    assert layer.attention == "full"
    heads, kv, d = layer.num_heads, XS2.num_kv_heads, XS2.head_dim
    context = blocks * keys
    q = torch.randn(rows, heads, d)
    positions = torch.arange(context, context + rows)

    def streamed():
        for b in range(blocks):  # each block's K/V made as it is needed, as a fetch from the host is
            yield KVBlock(torch.randn(kv, keys, d), torch.randn(kv, keys, d), torch.arange(b * keys, (b + 1) * keys),
                          all_visible=b > 0)

    gc.collect()
    with LiveBytes() as meter:
        out = attention_over_blocks(q, positions, streamed(), d**-0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()
    return meter.peak


def test_prefill_attention_memory_is_one_blocks_whatever_the_context_and_within_the_plan(one_thread):
    # XS.2 at 128K: the pool (8K) then 30 runs of 4K streamed from the host is 31 blocks; each block
    # here has few keys (the merge's memory does not depend on them; a streamed run's K/V is in the
    # planner's figure) but the real rows (a 2048-row prefill chunk) and heads.
    peaks = {blocks: prefill_attention_peak(blocks) for blocks in (2, 32)}
    assert max(peaks.values()) <= 1.05 * min(peaks.values()), peaks  # stacking grew ~50 MB per block
    rows, out_bytes = 2048, 2048 * XS2.layers[0].num_heads * XS2.head_dim * 4  # the output: in q/k/v/out
    assert peaks[32] <= merge_bytes(XS2, rows, torch.float32) + out_bytes, peaks


def test_running_merge_equals_the_stacked_merge_with_blind_blocks():
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(6, 5, 4, 8, generator=gen, dtype=torch.float64)
    lses = torch.randn(6, 5, 4, generator=gen, dtype=torch.float64)
    lses[1] = float("-inf")  # a block that saw nothing
    lses[:, 2] = float("-inf")  # a row no block saw
    outs[1], outs[:, 2] = 0.0, 0.0
    want, _ = merge_stacked(outs, lses)
    got = merge_partials(zip(outs, lses, strict=True))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    first = outs[0]
    assert merge_partials([(first, lses[0])]) is first  # one block: as it is, no copy


def test_host_kv_is_one_arena_of_the_planned_bytes():
    settings = CacheSettings.for_engine(131072, 512, "select", kv_pool_tokens=1024)
    cache = SequenceCache(XS2, settings, torch.bfloat16, torch.device("cpu"))  # pages untouched: nothing taken
    arena = cache.host_arena
    planned = plan(XS2, settings, torch.bfloat16)["kv_host_max"]
    assert abs(arena.capacity - planned) <= 0.05 * planned and abs(arena.taken - planned) <= 0.05 * planned
    paged = [layer for layer in cache.kv.values() if isinstance(layer, PagedKV)]
    assert len(paged) == 10
    for layer in paged:  # every layer's chunks are a view of the one allocation
        assert layer.residency.host.rows.untyped_storage().data_ptr() == arena.memory.untyped_storage().data_ptr()
    assert sum(layer.host_bytes() for layer in paged) <= arena.taken
    with pytest.raises(ValueError, match="cannot give"):
        arena.take(arena.capacity)


def test_a_pinned_arena_that_went_is_taken_back_by_the_next_of_its_size_after_its_copies(monkeypatch):
    """Page-locking gigabytes takes seconds and a cache is made per request: the lock is paid once."""
    locked, waits = [], []
    monkeypatch.setattr(host_arena, "_register", locked.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(1))
    monkeypatch.setattr(host_arena, "_RELEASED", {})
    first = HostArena(4096, pin=True)
    memory = first.memory.data_ptr()
    del first
    gc.collect()
    assert waits == [1]  # queued copies are done before anyone else may use the memory
    second, third = HostArena(4096, pin=True), HostArena(4096, pin=True)
    assert second.memory.data_ptr() == memory and third.memory.data_ptr() != memory
    assert len(locked) == 2  # the first's lock was kept; only the third, made beside it, locked anew
    assert HostArena(4096).memory.data_ptr() not in (memory, third.memory.data_ptr())  # unpinned: its own
    del second, third  # released while torch.cuda.synchronize is still the stand-in
    gc.collect()


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def filled_select_pool(length: int, pool: int = 1024) -> PagedKV:
    settings = KVFlashSettings("select", pool, 8192, 256)
    cache = PagedKV(settings, 2, 8, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for start in range(0, length, 256):
        step = Step(torch.arange(start, start + 256), prefill=True)
        cache.write(step, torch.randn(256, 2, 8, generator=gen), torch.randn(256, 2, 8, generator=gen))
        list(cache.blocks(torch.randn(256, 4, 8, generator=gen), step))
        cache.commit(start + 256)
    return cache


def test_a_reselection_runs_a_fixed_number_of_ops_however_many_chunks_it_loads():
    counts = {}
    for moved in (1, 4, 8):  # up to select_k
        cache = filled_select_pool(4096)  # 64 chunks, a pool of 16 slots: most chunks are on the host
        chosen = [c for c in range(1, 40) if c not in cache.residency.chunk_slot][:moved]
        with OpCount() as count:
            cache.policy._reselect(4096, chosen)
        assert set(chosen) <= cache.residency.chunk_slot.keys()
        for chunk in chosen:  # the loaded rows are the chunk's, where the page table says
            positions = torch.arange(chunk * 64, chunk * 64 + 64)
            assert torch.equal(cache.residency.row_positions[cache.residency.pool_rows(positions)], positions)
        counts[moved] = count.ops
    assert len(set(counts.values())) == 1 and counts[1] <= 40, counts  # 33 aten ops, views included


def test_a_decode_commit_that_chooses_again_runs_a_bounded_number_of_ops():
    cache, gen = filled_select_pool(4096), torch.Generator().manual_seed(1)
    for start in range(4096, 4160, 16):
        step = Step(torch.arange(start, start + 16))
        cache.write(step, torch.randn(16, 2, 8, generator=gen), torch.randn(16, 2, 8, generator=gen))
        list(cache.blocks(torch.randn(16, 4, 8, generator=gen), step))
        with OpCount() as count:
            cache.commit(start + 16)
    assert not cache.selection.due  # the last commit crossed a boundary and chose
    # 91 aten ops, views included, loading 5 chunks: summaries, the completed chunk's host copy, ranking, loads
    assert count.ops <= 100, count.ops


def test_a_prompt_chooses_kvflash_chunks_once_when_its_prefill_ends(reference_models, monkeypatch):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=4096, kv_pool_tokens=1024,
                      kv_policy="select", prefill_chunk=256, draft=None)
    choices = []
    monkeypatch.setattr(ChunkSelection, "choose", lambda self, ranking, real=ChunkSelection.choose:
                        choices.append(self) or real(self, ranking))
    prompt = [(i * 37) % 100 + 3 for i in range(2000)]  # 8 prefill chunks, each crossing reselect boundaries
    llm.generate(prompt, max_tokens=1)
    layers = sum(layer.attention == "full" for layer in llm.config.layers)
    assert len(choices) == layers and len(set(map(id, choices))) == layers  # once per layer, at the end
