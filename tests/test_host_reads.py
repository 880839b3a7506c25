"""How often decoding reads a device value on the host. On a GPU each read (`item`, `tolist`,
`int()` of a tensor) waits for every queued kernel, so host and device time add up instead of
overlapping. Counted here on the CPU, where the same torch code runs (on the GPU's paths: the
CPU's own MoE decode path reads its expert ids, `kernels.moe.reads_wait_for_nothing`): a plain
greedy step reads once (its chosen token), a speculative round twice (the drafts, then the
verdict), whether a DFlash block drafter or a draft model (fed its own drafts on the device) drafts.

KVFlash `select` re-selection (every `kv_reselect_every` committed tokens) runs as a step of its
own between decode steps and reads back the chunks it ranked (the host copies the chosen ones
into the pool), every full-attention layer's in one transfer: its reads are counted apart, and
there is one per re-selection."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from lucebox.kernels import moe

import lucebox
from lucebox.builtin import builtin_model
from lucebox.caches import SequenceCache

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def counted_reads(monkeypatch) -> Iterator[Counter]:
    """Counts host reads of tensor values, apart for those of re-selection (`SequenceCache._read_back`)."""
    counts: Counter[str] = Counter()
    inside = []

    def counting(original):
        def read(self, *args, **kwargs):
            counts["reselect" if inside else "step"] += 1
            return original(self, *args, **kwargs)
        return read

    def reselect(original):
        def run(tensors):
            inside.append(1)
            try:
                counts["reselections"] += bool(tensors)
                return original(tensors)
            finally:
                inside.pop()
        return staticmethod(run)

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
        m.setattr(SequenceCache, "_read_back", reselect(SequenceCache._read_back))
        m.setattr(moe, "reads_wait_for_nothing", lambda device: False)
        yield counts


ENGINE = dict(device="cpu", dtype="float32", max_context=4096, kv_policy="select", kv_pool_tokens=1024)
PROMPT = [(i * 7919) % 4000 + 5 for i in range(3000)]  # 3000 tokens: most of the context lives on the host


@pytest.fixture(scope="module")
def engines():
    return {draft: lucebox.LLM(builtin_model(), draft=draft, adaptive=False, draft_k=7, **ENGINE)
            for draft in (None, "auto", str(builtin_model()))}


@pytest.mark.parametrize("draft", [None, "auto", str(builtin_model())], ids=["plain", "dflash", "draft_model"])
def test_a_decode_step_reads_one_device_value_and_a_speculative_round_two(engines, draft, monkeypatch):
    llm = engines[draft]
    llm.generate(PROMPT, max_tokens=2, ignore_eos=True)  # prefill once; the measured request reuses it
    assert llm.memory()["kv_host"] > 0  # the pool is smaller than the context: chunks live on the host
    with counted_reads(monkeypatch) as reads:
        g = llm.generate(PROMPT + [11, 12], max_tokens=80, ignore_eos=True)
    rounds = g.stats["rounds"]
    assert g.stats["cached_prompt_tokens"] > 2900 and rounds > 10
    assert reads["reselections"] > 0  # 80 tokens cross a reselect boundary
    # The first token comes from the prefill's logits: one read, like a round.
    per_round = 1 if draft is None else 2
    assert reads["step"] <= per_round * (rounds + 1), (dict(reads), rounds)
    assert reads["reselect"] <= reads["reselections"], dict(reads)  # every layer's ranking in one read
