"""The decoder's layers are written once: every kind of forward (eager decoding, the graphed
decode/verify step, the batched training forward, batched generation) enters the one layer loop
(`Decoder.run`) once and runs each layer through the one per-layer function (`Decoder.run_layer`),
so a new token mixer or attention mask added there reaches them all. A forward that grows its own
loop over the layers fails here."""

from __future__ import annotations

import pytest
import torch
from lucebox.models.decoder import Decoder

import lucebox
from lucebox.caches import Step
from lucebox.engine.runner import StepRunner
from lucebox.training.forward import BatchCache, forward_batch, forward_cached

PROMPT = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))


@pytest.fixture
def layer_calls(monkeypatch):
    """Every entry into the layer loop ("loop") and every layer run (its index), in order."""
    calls: list = []
    run, run_layer = Decoder.run, Decoder.run_layer

    def counted_run(self, *args, **kwargs):
        calls.append("loop")
        return run(self, *args, **kwargs)

    def counted_layer(self, i, *args):
        calls.append(i)
        return run_layer(self, i, *args)

    monkeypatch.setattr(Decoder, "run", counted_run)
    monkeypatch.setattr(Decoder, "run_layer", counted_layer)
    return calls


def test_every_forward_runs_its_layers_through_the_one_loop(reference_models, layer_calls):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=256)
    llm.engine.runner = StepRunner(llm.decoder, graphs=True, capture=False)
    cache, prompt = llm.engine.new_cache(), PROMPT[0].tolist()
    one_pass = ["loop", *range(len(llm.config.layers))]

    def graphed_step():
        llm.runner.step(prompt[:3], Step.span(len(prompt), 3, llm.device), cache)
        assert llm.runner.widths  # the step took the graphed path

    forwards = {
        "eager prefill": lambda: llm.runner.step(prompt, Step.span(0, len(prompt), llm.device, prefill=True), cache),
        "graphed step": graphed_step,
        "training": lambda: forward_batch(llm.decoder, PROMPT, (0, 2)),
        "batched generation": lambda: forward_cached(llm.decoder, PROMPT, BatchCache(len(llm.config.layers))),
    }
    for name, forward in forwards.items():
        layer_calls.clear()
        forward()
        assert layer_calls == one_pass, f"{name}: {layer_calls}"
