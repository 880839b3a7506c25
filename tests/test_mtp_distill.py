"""`lucebox distill --heads mtp` (training/mtp_head.py): an MTP head trained for a target without
one, written as checkpoints ship theirs (mtp.*), taken by `draft=` and lossless."""

import json

import pytest
import torch
from mtp_cases import head_over, target_hidden
from safetensors.torch import load_file
from test_dspark import tiny_target  # noqa: F401 - the fixture

import lucebox
from lucebox.errors import DraftModelError


@pytest.fixture(scope="module")
def mtp_head(tiny_target, tmp_path_factory):  # noqa: F811 - the fixture
    from lucebox.cli import main

    target, flags = tiny_target
    flags = flags[: flags.index("--steps")] + ["--steps", "40", "--heads", "mtp"]  # (no DSpark flags)
    out = tmp_path_factory.mktemp("mtp") / "head"
    assert main(["distill", str(target), "--out", str(out), *flags]) == 0
    return target, out


def test_the_head_is_written_as_checkpoints_ship_theirs_and_drafts_losslessly(mtp_head):
    target, out = mtp_head
    config, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert config["mtp_num_hidden_layers"] == 1 and {"mtp.fc.weight", "mtp.norm.weight"} <= set(tensors)
    assert all(name.startswith("mtp.") for name in tensors)
    prompt = "def main(argv):\n    "
    plain = lucebox.LLM(target, device="cpu", dtype="float64", draft=None).generate(prompt, max_tokens=24,
                                                                                   ignore_eos=True)
    llm = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(out), adaptive=False)
    fast = llm.generate(prompt, max_tokens=24, ignore_eos=True)
    assert fast.token_ids == plain.token_ids and fast.stats["drafter"] == "mtp"
    # round trip: what was trained (state.pt) is what the file holds is what the engine drafts with
    state = torch.load(out / "training" / "state.pt", weights_only=True)["weights"]
    assert torch.equal(tensors["mtp.fc.weight"], state["fc"].to(torch.bfloat16))
    assert torch.equal(llm.proposer.head.fc, tensors["mtp.fc.weight"].double())


def _cross_entropy(llm, ids: list[int]) -> float:
    """The head's drafts against the target's distributions: depth 1 over ids, measured through
    the engine's own head and target (not the training loss)."""
    hidden = target_hidden(llm, ids)
    head = llm.proposer.head
    logq = torch.log_softmax(head.logits(head_over(head, ids[1:], hidden[:-1])), -1)
    p = torch.softmax(llm.engine.decoder.logits(hidden[1:]), -1)
    return -(p * logq).sum(-1).mean().item()


def test_training_brings_the_head_s_drafts_closer_to_the_target(mtp_head, tmp_path):
    from lucebox.training.mtp_head import initial_head, save_head

    target, out = mtp_head
    trained = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(out))
    save_head(tmp_path / "start", json.loads((target / "config.json").read_text()), trained.engine.decoder,
              initial_head(trained.engine.decoder, seed=0))
    start = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(tmp_path / "start"))
    ids = torch.load(out / "training" / "sequences.pt", weights_only=True)[0].tolist()
    assert _cross_entropy(trained, ids) < _cross_entropy(start, ids)
    log = json.loads((out / "training" / "distill_log.json").read_text())
    assert log["held_out_acceptance"]["acceptance_length"] >= 1.0


def test_the_speculators_layout_holds_the_same_head(mtp_head):
    """OUT/speculators: the Speculators library's "mtp" layout (its converter's names, fused
    experts), which draft= takes too and which runs the very same head."""
    target, out = mtp_head
    config, tensors = json.loads((out / "speculators" / "config.json").read_text()), load_file(
        out / "speculators" / "model.safetensors")
    assert (config["speculators_model_type"], config["architectures"], config["num_nextn_predict_layers"]) == (
        "mtp", ["MTPDraftModel"], 1)
    assert config["transformer_layer_config"]["hidden_size"] == json.loads((target / "config.json").read_text())[
        "hidden_size"]
    assert {"mtp_layers.0.input_proj.weight", "mtp_layers.0.final_layernorm.weight",
            "mtp_layers.0.hidden_layernorm.weight", "mtp_layers.0.token_layernorm.weight"} <= set(tensors)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in tensors)  # fused, as Speculators keeps them
    heads = [lucebox.LLM(target, device="cpu", dtype="float64", draft=str(folder)).proposer.head
             for folder in (out, out / "speculators")]
    for name, weight in heads[0].layer.w.items():
        assert torch.equal(weight, heads[1].layer.w[name]), name
    assert torch.equal(heads[0].fc, heads[1].fc) and torch.equal(heads[0].norm_hidden, heads[1].norm_hidden)
    assert torch.equal(heads[0].norm_embedding, heads[1].norm_embedding)


def test_a_head_of_another_target_is_refused_by_name(mtp_head, reference_models):
    with pytest.raises(DraftModelError, match=r"MTP head .* is not this target's: hidden_size"):
        lucebox.LLM(reference_models("qwen3_next")[0], device="cpu", draft=str(mtp_head[1]))


def test_mtp_takes_no_init_drafter(tiny_target, tmp_path):  # noqa: F811 - the fixture
    from lucebox.cli import main

    target, _ = tiny_target
    assert main(["distill", str(target), "--out", str(tmp_path / "x"), "--heads", "mtp", "--init",
                 str(tmp_path)]) == 2


def test_on_a_target_that_verifies_trees_the_head_drafts_them_losslessly(mtp_head, monkeypatch):
    """A plain-attention target (the tiny Laguna) verifies draft trees: the head's are built from
    its chain's per-position top tokens, and greedy and seeded coupled sampling stay the target's own."""
    from lucebox.speculative.mtp import MTPProposer

    target, out = mtp_head
    trees, own_tree = [], MTPProposer.own_tree
    monkeypatch.setattr(MTPProposer, "own_tree", lambda self, *a, **k: (lambda t: (trees.append(len(t)), t)[1])(
        own_tree(self, *a, **k)))
    prompt = "def main(argv):\n    "
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        plain = lucebox.LLM(target, device="cpu", dtype="float64", draft=None).generate(
            prompt, max_tokens=24, ignore_eos=True, **sampling)
        llm = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(out), adaptive=False, tree_budget=4)
        llm.proposer.lookup = None  # the head's own trees
        assert llm.generate(prompt, max_tokens=24, ignore_eos=True, **sampling).token_ids == plain.token_ids
    assert trees and max(trees) == 5  # `last` and 4 draft rows
