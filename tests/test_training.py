"""Training uses the engine's own model: the batched training forward equals the engine's, the
drafter's training forward equals what the engine's DFlash proposer computes (so the captured
target layers line up), and `lucebox train` + `lucebox distill` make models the engine runs."""

import json

import pytest
import torch
from drafters import save_dflash
from lucebox.models.dflash import DFlashDrafter

import lucebox
from lucebox.caches import Step
from lucebox.sampling import SamplingParams
from lucebox.training.distill import target_signals
from lucebox.training.drafter_forward import draft_hidden
from lucebox.training.forward import forward_batch, greedy_continuations

COMMON = dict(device="cpu", dtype="float64", max_context=512)
TOKENS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def laguna(reference_models):
    return reference_models("laguna")[0]


def test_batched_training_forward_equals_the_engine(laguna):
    llm = lucebox.LLM(laguna, **COMMON)
    hidden, features = forward_batch(llm.decoder, TOKENS, (0, 2))
    for row in range(len(TOKENS)):
        ids = TOKENS[row].tolist()
        assert torch.allclose(llm.decoder.logits(hidden[row]), llm.logits(ids), atol=1e-9)
        step, cache = Step(torch.arange(40)), llm._new_cache()
        _, engine_features = llm.decoder.forward_capturing(TOKENS[row], step, cache, (0, 2))
        assert torch.allclose(features[row], engine_features, atol=1e-9)


def test_batched_greedy_generation_equals_the_engine(laguna):
    llm = lucebox.LLM(laguna, **COMMON)
    out = greedy_continuations(llm.decoder, TOKENS[:, :12], 30)  # crosses the window (8) many times
    for row in range(len(TOKENS)):
        assert out[row, 12:].tolist() == llm.generate(TOKENS[row, :12].tolist(), max_tokens=30,
                                                      ignore_eos=True).token_ids


def _engine_draft(llm, tokens: list[int], anchor: int) -> torch.Tensor:
    """The engine's draft distribution (k, V) for the block after `tokens[:anchor + 1]` (temperature 1)."""
    proposer = llm.proposer
    for _ in llm._prefill(tokens[:anchor], llm._new_cache(), proposer):
        pass
    k = proposer.max_width
    return proposer.propose(tokens[: anchor + 1], k, SamplingParams(temperature=1.0), torch.Generator()).q


@pytest.mark.parametrize("layout", ["zlab", "laguna"])
def test_drafter_training_forward_is_the_engines_drafter(laguna, tmp_path, layout):
    """Trained blocks see what inference blocks see. Reading the features of the wrong target layer
    (one off), or one position off, changes every draft and fails here."""
    target_cfg = json.loads((laguna / "config.json").read_text())
    folder = save_dflash(tmp_path / layout, target_cfg, layout, target_layer_ids=(0, 2), scale=0.3)
    llm = lucebox.LLM(laguna, draft=str(folder), adaptive=False, prefill_chunk=16, **COMMON)
    drafter: DFlashDrafter = llm.proposer.drafter
    tokens = TOKENS[:1]
    _, features = target_signals(llm.decoder, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30]])
    hidden = draft_hidden(drafter, llm.decoder, features, tokens, anchors)  # (1, 3, block, H)
    for m, anchor in enumerate(anchors[0].tolist()):
        trained = torch.softmax(drafter.logits(llm.decoder, hidden[0, m, 1:]).double(), dim=-1)
        engine = _engine_draft(llm, tokens[0].tolist(), anchor)
        assert torch.allclose(trained, engine, atol=1e-9), f"anchor {anchor}"
