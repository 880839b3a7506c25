"""The graphed decode/verify step is position-independent: a CUDA graph captured at one position
replays correctly at any other only if the step's device work is the same launches with the same
arguments everywhere, reading the same buffers, with everything that moves (positions, ring
slots, the pool's page table, pinned rows) in device tensors.

On the CPU the step body runs eagerly under a recorder of every ATen op it dispatches: the op,
each tensor argument's shape, stride and dtype (and, for tensors the step did not make, its
address: a buffer reallocated between steps would leave a graph reading freed memory), and
every non-tensor argument. Steps at consecutive positions must record the same sequence, across
sliding-ring wraps, pool chunk boundaries, chunks leaving for the host, and KVFlash re-selection."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from lucebox.kernels import cpu_rows, moe
from tiny_models import VOCAB
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lucebox
from lucebox.caches import Step
from lucebox.caches.paged import PagedKV
from lucebox.caches.ring import SlidingRing
from lucebox.engine.runner import StepGraph, StepRunner


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self._made: set[int] = set()  # storages of tensors this step produced

    def _describe(self, value):
        if isinstance(value, torch.Tensor):
            made = value.untyped_storage().data_ptr() in self._made
            where = "made in the step" if made else value.data_ptr()
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), where)
        return ("value", repr(value))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), tuple(self._describe(a) for a in tree_flatten((args, kwargs))[0])))
        out = func(*args, **kwargs)
        # A view or an in-place op hands back storage it was given; anything else is new.
        given = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self._made.add(t.untyped_storage().data_ptr())
        return out


def on_gpu_paths(monkeypatch) -> None:
    """The step takes the paths a GPU's graph takes: not the CPU's own MoE decode path (it reads the
    ids) nor its oneDNN-packed head (packed at the first step)."""
    monkeypatch.setattr(moe, "reads_wait_for_nothing", lambda device: False)
    monkeypatch.setattr(cpu_rows.PackedWeight, "usable", lambda self, x: False)


def record_bodies(monkeypatch) -> dict[int, list[tuple[int, list]]]:
    """From now on every run of the step body is recorded: width -> [(position, ops)], on the
    paths a GPU takes (the CPU's own MoE decode path reads the ids: no graph ever runs it)."""
    on_gpu_paths(monkeypatch)
    recordings: dict[int, list[tuple[int, list]]] = defaultdict(list)
    body = StepGraph.body

    def recorded_body(graph):
        recorder = OpRecorder()
        with recorder:
            out = body(graph)
        recordings[graph.inputs.shape[1]].append((int(graph.inputs[1, 0]), recorder.ops))
        return out

    monkeypatch.setattr(StepGraph, "body", recorded_body)
    return recordings


def assert_same_ops_at_every_position(recordings: dict[int, list[tuple[int, list]]]) -> None:
    for width, steps in recordings.items():
        first_position, first = steps[0]
        assert any("index_copy_" in op for op, _ in first)  # the cache stores are in the step
        for position, ops in steps[1:]:
            assert len(ops) == len(first), f"width {width}: {len(ops)} ops at {position}, {len(first)} before"
            for i, (a, b) in enumerate(zip(first, ops, strict=True)):
                assert a == b, f"width {width}, op {i}: {a} at {first_position} but {b} at {position}"


def step_and_keep(llm, cache, position: int, width: int, gen: torch.Generator) -> int:
    """One step of `width` random rows, all but one kept when width > 1 (a verify that rejected
    its last draft); the position after what was kept."""
    rows = torch.randint(0, VOCAB, (width,), generator=gen).tolist()
    llm.engine.runner.step(rows, Step.span(position, width, llm.device), cache)
    kept = 1 if width == 1 else width - 1
    cache.commit(position + kept)
    if kept < width:
        cache.rollback(position + kept)
    return position + kept


@pytest.fixture
def recorded_steps(reference_models, monkeypatch):
    """Recordings of the step body, by width, over a stretch of decoding past the pool."""
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=1024, kv_pool_tokens=640,
                      kv_policy="select", kv_reselect_every=16, prefill_chunk=64)
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    events = defaultdict(int)
    recordings = record_bodies(monkeypatch)
    prompt = torch.randint(0, VOCAB, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = llm.engine.new_cache()
    for _ in llm.engine.prefill(prompt, cache):
        pass
    paged = next(layer for layer in cache.layers if isinstance(layer, PagedKV))
    ring = next(layer for layer in cache.layers if isinstance(layer, SlidingRing))
    position, gen = len(prompt), torch.Generator().manual_seed(6)
    while position < 780:
        before = (set(paged.residency.chunk_slot), list(paged.selected), ring.highest // ring.capacity)
        # Width 1 (plain decoding) and verify blocks of 3 of which 2 are kept and 1 rolled back,
        # never spanning a reselect boundary (as the engine steps).
        width = 1 if position < 740 else min(3, cache.rows_before_reselect(position))
        position, last = step_and_keep(llm, cache, position, width, gen), position
        kept = position - last
        after = (set(paged.residency.chunk_slot), list(paged.selected), ring.highest // ring.capacity)
        events["chunk left the pool"] += bool(before[0] - after[0])
        events["re-selection changed the chosen chunks"] += before[1] != after[1]
        events["ring wrapped"] += before[2] != after[2]
        events["chunk boundary crossed"] += position // 64 != (position - kept) // 64
    return recordings, events


def test_the_step_records_the_same_ops_at_every_position(recorded_steps):
    recordings, events = recorded_steps
    assert all(events[e] >= 1 for e in ("chunk left the pool", "re-selection changed the chosen chunks",
                                        "ring wrapped", "chunk boundary crossed")), dict(events)
    assert len(recordings[1]) >= 40 and len(recordings[3]) >= 10
    assert_same_ops_at_every_position(recordings)


def test_a_hybrid_step_records_the_same_ops_at_every_position(reference_models, monkeypatch):
    """Gated DeltaNet layers read and write their state slots at position % ring, computed on the
    device: the same launches wherever the step is, around the ring several times."""
    folder, _ = reference_models("qwen3_next")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", prefill_chunk=16)
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    recordings = record_bodies(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    cache = llm.engine.new_cache()
    for _ in llm.engine.prefill(torch.randint(0, VOCAB, (40,), generator=gen).tolist(), cache):
        pass
    position = 40
    for i in range(36):
        position = step_and_keep(llm, cache, position, 1 if i % 2 else 3, gen)
    ring = next(layer.ring for layer in cache.layers if hasattr(layer, "ring"))
    assert position - 40 > 2 * ring and len(recordings[1]) == len(recordings[3]) == 18
    assert_same_ops_at_every_position(recordings)
