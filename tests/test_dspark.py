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
    _, features = target_signals(llm.engine.decoder, TOKENS, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30]])
    hidden = draft_hidden(drafter, llm.engine.decoder, features, TOKENS, anchors)[0, :, 1:]  # (3, bs-1, H)
    moved = 0
    for m, anchor in enumerate(anchors[0].tolist()):
        base = drafter.logits(llm.engine.decoder, hidden[m])
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
    llm = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, tree_budget=0, **COMMON)
    llm.proposer.lookup = None  # every draft from the heads
    fast = llm.generate(prompt, max_tokens=64, ignore_eos=True)
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


def test_a_frozen_backbone_gets_no_gradient_and_the_heads_do(laguna, dspark):
    from lucebox.training.distill import DistillSettings, distill_loss, position_weights

    llm = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, device="cpu", dtype="float32")
    drafter = llm.proposer.drafter
    for w in drafter.w.values():
        w.requires_grad_()
    anchors = torch.tensor([[3, 11, 20]])
    for frozen in (True, False):
        for w in drafter.w.values():
            w.grad = None
        loss, agree = distill_loss(drafter, llm.engine.decoder, TOKENS, anchors, position_weights(DistillSettings()),
                                   frozen=frozen)
        loss.backward()
        assert agree.shape == (drafter.cfg.block_size - 1,)
        assert all(drafter.w[n].grad is not None for n in ("markov_w1", "markov_w2", "confidence_w", "confidence_b"))
        assert (drafter.w["fc"].grad is None) == frozen


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny Laguna with a tokenizer, made by `lucebox train` (3 steps), and the distill flags for it."""
    from test_training import TINY_LAGUNA

    from lucebox.cli import main
    from lucebox.training.corpus import stdlib_root

    root = tmp_path_factory.mktemp("distill_dspark")
    data = [str(stdlib_root() / name) for name in ("bisect.py", "colorsys.py", "keyword.py")]
    (root / "config.json").write_text(json.dumps(TINY_LAGUNA))
    target = root / "target"
    assert main(["train", str(target), "--data", *data, "--eval-data", data[0], "--config", str(root / "config.json"),
                 "--steps", "3", "--batch", "2", "--length", "32", "--vocab-size", "400", "--eval-every", "2"]) == 0
    flags = ["--data", *data, "--eval-data", data[0], "--batch", "2", "--anchors", "4", "--sequences", "4",
             "--prompt-tokens", "16", "--generated-tokens", "16", "--eval-prompts", "1", "--eval-tokens", "16",
             "--steps", "2", "--heads", "dspark", "--markov-rank", "4"]
    return target, flags


def written(folder):
    from safetensors.torch import load_file

    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def loads_and_drafts_losslessly(target, drafter):
    prompt = "def main(argv):\n    "
    plain = lucebox.LLM(target, device="cpu", dtype="float64").generate(prompt, max_tokens=24, ignore_eos=True)
    llm = lucebox.LLM(target, device="cpu", dtype="float32", draft=str(drafter), adaptive=False)
    assert llm.proposer.drafter.heads is not None
    fast = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(drafter), adaptive=False).generate(
        prompt, max_tokens=24, ignore_eos=True)
    assert fast.token_ids == plain.token_ids
    return llm


def test_distill_dspark_writes_the_speculators_layout_and_it_loads(tiny_target, tmp_path):
    from lucebox.cli import main

    target, flags = tiny_target
    out = tmp_path / "dspark"
    assert main(["distill", str(target), "--out", str(out), *flags, "--layers", "1", "--attention-heads", "2",
                 "--kv-heads", "1", "--head-dim", "8", "--intermediate-size", "32", "--block-size", "4"]) == 0
    config, tensors = written(out)
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert (config["markov_rank"], config["sample_from_anchor"], config["enable_confidence_head"]) == (4, False, True)
    assert tensors["markov_head.markov_w1.weight"].shape == (config["transformer_layer_config"]["vocab_size"], 4)
    llm = loads_and_drafts_losslessly(target, out)
    # round trip: what was trained (state.pt) is what the file holds is what the engine loaded
    state = torch.load(out / "training" / "state.pt", weights_only=True)["weights"]
    from lucebox.models.dflash import sources
    from lucebox.models.sources import leaf_names

    for name, source in sources(llm.proposer.drafter.cfg).items():
        if name.startswith(("markov", "confidence")):
            stored = tensors[next(leaf_names(source))]
            assert torch.equal(stored, state[name].to(torch.bfloat16)), name
            assert torch.equal(llm.proposer.drafter.w[name], stored.float()), name
    assert state["markov_w2"].abs().sum() > 0  # the Markov head trained away from its zero start
    report = json.loads((out / "training" / "distill_log.json").read_text())
    assert report["held_out_acceptance"]["acceptance_length"] >= 1.0


def test_distill_adds_heads_to_an_existing_drafter_with_its_backbone_frozen(tiny_target, tmp_path):
    from lucebox.cli import main

    target, flags = tiny_target
    init = save_dflash(tmp_path / "init", json.loads((target / "config.json").read_text()), "zlab",
                       block=4, target_layer_ids=(1, 2), scale=0.2)
    out = tmp_path / "heads"
    assert main(["distill", str(target), "--out", str(out), *flags, "--init", str(init), "--freeze-backbone",
                 "--lr", "1"]) == 0  # a rate that would move an unfrozen backbone visibly in 2 steps
    config, tensors = written(out)
    _, before = written(init)
    assert config["aux_hidden_state_layer_ids"] == [2, 3] and config["block_size"] == 4  # the init drafter's
    for name, tensor in before.items():  # the backbone is the init drafter's, unchanged (stored as bf16)
        assert torch.equal(tensors[name], tensor.to(torch.bfloat16)), name
    assert tensors["markov_head.markov_w2.weight"].abs().sum() > 0  # the heads trained
    loads_and_drafts_losslessly(target, out)


@pytest.mark.parametrize("flags, says", [
    (["--freeze-backbone"], "--freeze-backbone"),
    (["--markov-rank", "0"], "--markov-rank"),
    (["--init", "no-such-folder"], "no-such-folder"),
])
def test_bad_head_flags_are_refused_by_name(tiny_target, tmp_path, capsys, flags, says):
    from lucebox.cli import main

    target, base = tiny_target
    assert main(["distill", str(target), "--out", str(tmp_path / "x"), *base, *flags]) == 2
    assert says in capsys.readouterr().err


def test_training_feeds_each_row_the_token_before_it_as_inference_does(laguna, dspark):
    """Teacher-forced training logits equal the position-by-position chain (the engine's, see the
    first test) given the sequence's own tokens a .. a + bs - 2 as previous tokens."""
    from lucebox.training.distill import drafted_logits

    llm = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, **COMMON)
    drafter = llm.proposer.drafter
    _, features = target_signals(llm.engine.decoder, TOKENS, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([[5, 17]])
    logits, hidden, _ = drafted_logits(drafter, llm.engine.decoder, features, TOKENS, anchors)
    J = drafter.cfg.block_size - 1
    for m, a in enumerate(anchors[0].tolist()):
        base = drafter.logits(llm.engine.decoder, hidden[0, m])  # the backbone's own logits
        ref, _ = reference_chain(drafter, base, hidden[0, m], TOKENS[0, a : a + J].tolist())
        assert torch.allclose(logits[0, m], ref.float(), atol=1e-5)


def test_the_confidence_target_is_the_keep_rate():
    from lucebox.training.dspark_loss import keep_rate

    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    assert torch.allclose(keep_rate(p, q.clamp_min(1e-30).log()), torch.tensor([0.5, 1.0]))


def test_dspark_tree_is_the_best_paths_with_children_following_their_parent_token(laguna, dspark):
    """A DSpark drafter's tree: each node's probability is its position's logits biased by its
    parent's token (the root's: the anchor); no extension left out is more probable than a node
    kept (best first); and greedy trees through the engine stay lossless."""
    from lucebox.speculative.dspark import markov_tree

    llm = lucebox.LLM(laguna, draft=str(dspark), adaptive=False, tree_budget=10, **COMMON)
    w = llm.proposer.drafter.w
    base = torch.randn(7, 128, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4  # peaked rows

    def children(depth, token):  # position depth + 1's distribution after `token`, written out
        return torch.softmax(base[depth] + w["markov_w2"] @ w["markov_w1"][token], -1)

    tree = markov_tree(llm.proposer.drafter.heads, base, 38, 10)
    assert len(tree) == 11 and tree.depth >= 2
    for i in range(1, len(tree)):
        parent = tree.parents[i]
        q = tree.probabilities[i] / tree.probabilities[parent]
        assert tree.depths[i] == tree.depths[parent] + 1 and parent < i
        assert q == pytest.approx(children(tree.depths[parent], tree.tokens[parent])[tree.tokens[i]].item(), rel=1e-5)
    weakest = min(tree.probabilities[1:])
    for row in range(len(tree)):
        if tree.depths[row] < 7:
            kept = {tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == row}
            left = [p for t, p in enumerate(children(tree.depths[row], tree.tokens[row]).tolist()) if t not in kept]
            best_left = tree.probabilities[row] * max(left)
            assert best_left <= weakest * (1 + 1e-5), f"a better child of row {row} was left out"
    prompt = TOKENS[0, :20].tolist()
    plain = lucebox.LLM(laguna, **COMMON).generate(prompt, max_tokens=48, ignore_eos=True)
    assert llm.generate(prompt, max_tokens=48, ignore_eos=True).token_ids == plain.token_ids
