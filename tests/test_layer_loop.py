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
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    cache, prompt = llm.engine.new_cache(), PROMPT[0].tolist()
    one_pass = ["loop", *range(len(llm.config.layers))]

    def graphed_step():
        llm.engine.runner.step(prompt[:3], Step.span(len(prompt), 3, llm.device), cache)
        assert llm.engine.runner.widths  # the step took the graphed path

    forwards = {
        "eager prefill": lambda: llm.engine.runner.step(prompt, Step.span(0, len(prompt), llm.device, prefill=True),
                                                        cache),
        "graphed step": graphed_step,
        "training": lambda: forward_batch(llm.engine.decoder, PROMPT, (0, 2)),
        "batched generation": lambda: forward_cached(llm.engine.decoder, PROMPT, BatchCache(len(llm.config.layers))),
    }
    for name, forward in forwards.items():
        layer_calls.clear()
        forward()
        assert layer_calls == one_pass, f"{name}: {layer_calls}"


def test_the_drafter_s_layers_are_written_once_too(monkeypatch):
    """The DFlash drafter's layer body (`DFlashDrafter.run_layer`) serves the engine's draft and
    training's batched forward (`draft_hidden`): each runs every drafter layer through it, in order."""
    from lucebox.models.dflash import DFlashDrafter

    from lucebox.training.distill import target_signals
    from lucebox.training.drafter_forward import draft_hidden

    calls: list[int] = []
    run_layer = DFlashDrafter.run_layer

    def counted(self, layer, *args):
        calls.append(layer)
        return run_layer(self, layer, *args)

    monkeypatch.setattr(DFlashDrafter, "run_layer", counted)
    llm = lucebox.LLM(adaptive=False)  # the built-in model and its DFlash drafter, drafting every round
    drafter = llm.proposer.drafter
    layers = list(range(drafter.cfg.num_layers))
    llm.generate("def mean(xs):\n", max_tokens=8, speculate=True, ignore_eos=True)
    assert calls and len(calls) % len(layers) == 0 and calls == layers * (len(calls) // len(layers))
    calls.clear()
    _, features = target_signals(llm.engine.decoder, PROMPT[:1], drafter.cfg.target_layer_ids)
    draft_hidden(drafter, llm.engine.decoder, features, PROMPT[:1], torch.tensor([[2, 5]]))
    assert calls == layers
