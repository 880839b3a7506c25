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
TOKENS = torch.randint(0, 128, (2, 72), generator=torch.Generator().manual_seed(3))  # > 64: two delta-rule chunks


# Laguna (full and sliding attention) and the hybrids (Gated DeltaNet and full attention; Qwen3-Next's
# grouped projections, Qwen3.5's flat ones; Kimi Linear's KDA and latent attention): a hybrid's
# batch of two different sequences equals each one prefilled alone, so no recurrent state leaks
# from one into the other.
TARGETS = ["laguna", "qwen3_next", "qwen3_5", "kimi_linear"]


@pytest.mark.parametrize("name", TARGETS)
def test_batched_training_forward_equals_the_engine(reference_models, name):
    llm = lucebox.LLM(reference_models(name)[0], prefill_chunk=16, **COMMON)
    hidden, features = forward_batch(llm.engine.decoder, TOKENS, (0, 2))
    for row in range(len(TOKENS)):
        ids = TOKENS[row].tolist()
        # 16-row prefill chunks
        assert torch.allclose(llm.engine.decoder.logits(hidden[row]), llm.logits(ids), atol=1e-9)
        assert torch.allclose(features[row], _prefill_features(llm, TOKENS[row], (0, 2)), atol=1e-9)


def _prefill_features(llm, ids: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """The outputs of decoder `layers` for `ids`, captured by the engine's chunked prefill."""
    cache, chunk, out = llm.engine.new_cache(), llm.setup.prefill_chunk, []
    for begin in range(0, len(ids), chunk):
        step = Step.span(begin, min(chunk, len(ids) - begin), llm.device, prefill=True)
        out.append(llm.engine.decoder.forward_capturing(ids[step.start:step.end], step, cache, layers)[1])
        cache.commit(step.end)
    return torch.cat(out)


@pytest.mark.parametrize("name", TARGETS)
def test_batched_greedy_generation_equals_the_engine(reference_models, name):
    llm = lucebox.LLM(reference_models(name)[0], **COMMON)
    out = greedy_continuations(llm.engine.decoder, TOKENS[:, :12], 30)  # crosses the window (8) many times
    for row in range(len(TOKENS)):
        assert out[row, 12:].tolist() == llm.generate(TOKENS[row, :12].tolist(), max_tokens=30,
                                                      ignore_eos=True).token_ids


def _engine_draft(llm, tokens: list[int], anchor: int, temperature: float = 1.0):
    """The engine's draft for the block after `tokens[:anchor + 1]`."""
    proposer = llm.proposer
    proposer.start(tokens[:anchor], None)
    for _ in llm.engine.prefill(tokens[:anchor], llm.engine.new_cache(), proposer):
        pass
    k = proposer.max_width
    return proposer.propose(tokens[: anchor + 1], k, SamplingParams(temperature=temperature), torch.Generator())


@pytest.mark.parametrize("layout", ["zlab", "laguna"])
def test_drafter_training_forward_is_the_engines_drafter(laguna, tmp_path, layout):
    """Trained blocks see what inference blocks see. Reading the features of the wrong target layer
    (one off), or one position off, changes every draft and fails here."""
    target_cfg = json.loads((laguna / "config.json").read_text())
    folder = save_dflash(tmp_path / layout, target_cfg, layout, target_layer_ids=(0, 2), scale=0.3)
    llm = lucebox.LLM(laguna, draft=str(folder), adaptive=False, prefill_chunk=16, **COMMON)
    drafter: DFlashDrafter = llm.proposer.drafter
    tokens = TOKENS[:1]
    _, features = target_signals(llm.engine.decoder, tokens, drafter.cfg.target_layer_ids)
    anchors = torch.tensor([[5, 17, 30]])
    hidden = draft_hidden(drafter, llm.engine.decoder, features, tokens, anchors)  # (1, 3, block, H)
    for m, anchor in enumerate(anchors[0].tolist()):
        trained = torch.softmax(drafter.logits(llm.engine.decoder, hidden[0, m, 1:]).double(), dim=-1)
        engine = _engine_draft(llm, tokens[0].tolist(), anchor).q
        assert torch.allclose(trained, engine, atol=1e-9), f"anchor {anchor}"
        greedy = _engine_draft(llm, tokens[0].tolist(), anchor, temperature=0.0)
        assert greedy.tokens == trained.argmax(-1).tolist()
        # greedy confidence is the drafter's own belief (its softmax), not the one-hot it drafts from
        assert greedy.confidence == pytest.approx(trained.max(-1).values.tolist(), abs=1e-6)


TINY_LAGUNA = {
    "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 300, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_attention_heads_per_layer": [2, 4, 4, 4], "num_key_value_heads": 1, "head_dim": 8,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "moe_routed_scaling_factor": 2.5,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "sliding_window": 16, "gating": True,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    """A tiny Laguna and a DFlash drafter made by `lucebox train` and `lucebox distill` (a few steps each)."""
    from lucebox.cli import main
    from lucebox.training.corpus import stdlib_root

    root = tmp_path_factory.mktemp("trained")
    data = [str(stdlib_root() / name) for name in ("bisect.py", "colorsys.py", "keyword.py", "glob.py")]
    held_out = str(stdlib_root() / "heapq.py")
    (root / "config.json").write_text(json.dumps(TINY_LAGUNA))
    target, drafter = root / "target", root / "drafter"
    assert main(["train", str(target), "--data", *data, "--eval-data", held_out, "--config", str(root / "config.json"),
                 "--steps", "3", "--batch", "2", "--length", "32", "--vocab-size", "400", "--eval-every", "2"]) == 0
    distill = ["distill", str(target), "--out", str(drafter), "--data", *data, "--eval-data", held_out,
               "--batch", "2", "--anchors", "4", "--sequences", "4", "--prompt-tokens", "16",
               "--generated-tokens", "16", "--layers", "1", "--attention-heads", "2", "--kv-heads", "1",
               "--head-dim", "8", "--intermediate-size", "32", "--block-size", "4", "--eval-prompts", "1",
               "--eval-tokens", "16"]
    assert main([*distill, "--steps", "2"]) == 0
    assert main([*distill, "--steps", "4", "--resume"]) == 0  # goes on from step 2
    return target, drafter


def test_train_writes_a_model_folder_with_its_measurements(trained_tiny):
    target, _ = trained_tiny
    for name in ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
                 "generation_config.json"):
        assert (target / name).is_file(), name
    report = json.loads((target / "training" / "train_log.json").read_text())
    assert report["log"][-1]["step"] == 3 and report["held_out_bits_per_char"] > 0
    assert 0 < report["xz_9e_bits_per_char"] < 8
    assert lucebox.LLM(target, device="cpu").tokenizer.decode(lucebox.LLM(target).tokenizer.encode(
        "def f(x):\n    return x  # ok\n")) == "def f(x):\n    return x  # ok\n"


def test_distill_resumes_and_its_drafter_is_lossless(trained_tiny):
    target, drafter = trained_tiny
    report = json.loads((drafter / "training" / "distill_log.json").read_text())
    assert [r["step"] for r in report["log"]] == [1, 2, 4]  # the second run went on from step 2
    assert report["held_out_acceptance"]["acceptance_length"] >= 1.0
    config = json.loads((drafter / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["block_size"] == 4
    prompt = "def main(argv):\n    "
    plain = lucebox.LLM(target, device="cpu", dtype="float64").generate(prompt, max_tokens=40, ignore_eos=True)
    llm = lucebox.LLM(target, device="cpu", dtype="float64", draft=str(drafter), adaptive=False)
    fast = llm.generate(prompt, max_tokens=40, ignore_eos=True)
    assert fast.token_ids == plain.token_ids
    assert fast.stats["rounds"] < 40 or fast.stats["acceptance_length"] == 1.0


def test_held_out_bits_score_every_token_once_with_context_carried_across_windows():
    from lucebox.models import build_model_config
    from lucebox.models.decoder import Decoder

    from lucebox.training.target import evaluate_bits, init_weights

    hf = {**TINY_LAGUNA, "vocab_size": 64}
    cfg = build_model_config(hf)
    weights = init_weights(hf, 0)
    docs = [list(range(1, 40)), [5, 6, 7], [1]]
    uniform = Decoder(cfg, {n: torch.zeros_like(w) for n, w in weights.items()})  # every token costs 6 bits
    assert evaluate_bits(uniform, docs, 8) == pytest.approx((38 + 2) * 6)
    model = Decoder(cfg, weights)
    whole = evaluate_bits(model, docs, 64)  # one window holds each document
    assert evaluate_bits(model, docs, 64, batch=1) == pytest.approx(whole)
    assert evaluate_bits(model, docs, 8) != pytest.approx(whole, rel=1e-9)  # shorter context, other bits
