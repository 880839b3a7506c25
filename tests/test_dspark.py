"""DSpark heads on the DFlash drafter: the Markov head conditions each block position on the draft
before it, the confidence head becomes Draft.confidence, speculation with them stays lossless, the
Speculators layout loads (DFlash and DSpark), and `lucebox distill --heads dspark` writes drafters
that load and draft."""

import json

import pytest
import torch
from drafters import save_dflash, to_speculators_layout

import lucebox
from lucebox.errors import DraftModelError
from lucebox.sampling import SamplingParams
from lucebox.training.distill import target_signals
from lucebox.training.drafter_forward import draft_hidden

COMMON = dict(device="cpu", dtype="float64", max_context=512)
TOKENS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def laguna(reference_models):
    return reference_models("laguna")[0]


@pytest.fixture(scope="module")
def target_cfg(laguna):
    return json.loads((laguna / "config.json").read_text())


@pytest.fixture(scope="module")
def dspark(laguna, target_cfg, tmp_path_factory):
    folder = save_dflash(tmp_path_factory.mktemp("dspark"), target_cfg, "zlab", target_layer_ids=(0, 2), scale=0.3)
    return to_speculators_layout(folder, "dspark")


def engine_draft(llm, tokens: list[int], anchor: int, temperature: float):
    """The engine's draft for the block after `tokens[:anchor + 1]`, every position drafted."""
    proposer = llm.proposer
    proposer.start(tokens[:anchor], None)
    for _ in llm.engine.prefill(tokens[:anchor], llm.engine.new_cache(), proposer):
        pass
    generator = torch.Generator().manual_seed(anchor)
    return proposer.propose(tokens[: anchor + 1], proposer.max_width, SamplingParams(temperature=temperature),
                            generator)


def reference_chain(drafter, base: torch.Tensor, hidden: torch.Tensor, prevs: list[int]):
    """Position by position, written out from the heads' weights: logits after the Markov bias of
    each position's previous token, and the confidence head's sigmoid."""
    w = drafter.w
    logits, confidence = [], []
    for j, prev in enumerate(prevs):
        emb = w["markov_w1"][prev]
        logits.append(base[j] + w["markov_w2"] @ emb)
        features = torch.cat([hidden[j], emb])
        confidence.append(torch.sigmoid(w["confidence_w"][0] @ features + w["confidence_b"][0]).item())
    return torch.stack(logits), confidence


def test_markov_head_reads_the_draft_before_each_position(laguna, dspark):
    """Drafts, q and confidences equal an independent position-by-position chain whose first previous
    token is the anchor and whose j-th is draft j - 1. Feeding any position the wrong previous token
    (off by one in the block) changes the drafts here: the bias is strong enough to move the argmax."""
    llm = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, prefill_chunk=16, **COMMON)
    drafter = llm.proposer.drafter
    assert drafter.heads is not None
    tokens = TOKENS[0].tolist()
    _, features = target_signals(llm.decoder, TOKENS, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30]])
    hidden = draft_hidden(drafter, llm.decoder, features, TOKENS, anchors)[0, :, 1:]  # (3, bs-1, H)
    moved = 0
    for m, anchor in enumerate(anchors[0].tolist()):
        base = drafter.logits(llm.decoder, hidden[m])
        greedy = engine_draft(llm, tokens, anchor, 0.0)
        ref, confidence = reference_chain(drafter, base, hidden[m], [tokens[anchor], *greedy.tokens[:-1]])
        assert greedy.tokens == ref.argmax(-1).tolist(), f"anchor {anchor}"
        assert greedy.confidence == pytest.approx(confidence, abs=1e-6)  # the head answers in float32
        assert all(0.0 <= c <= 1.0 for c in greedy.confidence)
        moved += greedy.tokens != base.argmax(-1).tolist()
        sampled = engine_draft(llm, tokens, anchor, 1.0)
        ref, confidence = reference_chain(drafter, base, hidden[m], [tokens[anchor], *sampled.tokens[:-1]])
        # q is the biased distribution each sampled draft was drawn from, given the draws before it
        assert torch.allclose(sampled.q, torch.softmax(ref, -1).double(), atol=1e-9), f"anchor {anchor}"
        assert sampled.confidence == pytest.approx(confidence, abs=1e-6)
    assert moved  # the heads matter: without them the drafts would differ


def test_greedy_speculation_with_dspark_equals_plain_decoding(laguna, dspark):
    prompt = TOKENS[0, :20].tolist()
    plain = lucebox.LLM(laguna, **COMMON).generate(prompt, max_tokens=64, ignore_eos=True)
    fast = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, **COMMON).generate(prompt, max_tokens=64,
                                                                                     ignore_eos=True)
    assert fast.token_ids == plain.token_ids
    assert fast.stats["rounds"] < 64 or fast.stats["acceptance_length"] == 1.0
    assert fast.stats["confidence_by_position"] and all(0 <= c <= 1 for c in fast.stats["confidence_by_position"])


def test_speculators_dflash_layout_drafts_as_the_zlab_layout(laguna, target_cfg, tmp_path):
    """The same weights in both layouts draft the same: aux_hidden_state_layer_ids (1, 3) are the
    z-lab target layers (0, 2) (reading them unshifted reads other layers and drafts differently)."""
    zlab = save_dflash(tmp_path / "zlab", target_cfg, "zlab", target_layer_ids=(0, 2), scale=0.3)
    ours = lucebox.LLM(laguna, draft=str(zlab), adaptive=False, prefill_chunk=16, **COMMON)
    expected = engine_draft(ours, TOKENS[0].tolist(), 17, 1.0).q
    spec = to_speculators_layout(save_dflash(tmp_path / "spec", target_cfg, "zlab", target_layer_ids=(0, 2),
                                             scale=0.3), "dflash")
    assert json.loads((spec / "config.json").read_text())["aux_hidden_state_layer_ids"] == [1, 3]
    llm = lucebox.LLM(laguna, draft=str(spec), adaptive=False, prefill_chunk=16, **COMMON)
    assert llm.proposer.drafter.heads is None
    assert torch.allclose(engine_draft(llm, TOKENS[0].tolist(), 17, 1.0).q, expected, atol=1e-12)


@pytest.mark.parametrize("change, key", [
    ({"sample_from_anchor": True}, "sample_from_anchor"),
    ({"draft_vocab_size": 64}, "draft_vocab_size"),
    ({"markov_head_type": "gated"}, "markov_head_type"),
    ({"aux_hidden_state_layer_ids": [0, 3]}, "aux_hidden_state_layer_ids"),
    ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
])
def test_what_lucebox_cannot_run_is_refused_by_name(laguna, dspark, tmp_path, change, key):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(dspark, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(DraftModelError, match=key):
        lucebox.LLM(laguna, draft=str(folder), **COMMON)
