"""The built-in model and its drafter: shipped in the package, the default everywhere, better than
xz at compressing code it never saw, and lossless with its trained drafter."""

import lzma
import math
from collections import Counter

import pytest
import torch

import lucebox
from lucebox.builtin import BUILTIN_DRAFTER, BUILTIN_MODEL
from lucebox.cli import main
from lucebox.speculative.dflash import DFlashProposer
from lucebox.training.corpus import HELD_OUT, stdlib_files, stdlib_root
from lucebox.training.target import evaluate_bits


@pytest.fixture(scope="module")
def builtin():
    return lucebox.LLM(device="cpu", dtype="float32", draft=None)


@pytest.fixture(scope="module")
def drafted():
    return lucebox.LLM(device="cpu", dtype="float32", draft="auto")


def test_builtin_model_fits_its_budget_and_is_a_normal_model_folder():
    files = [f for f in BUILTIN_MODEL.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 16 * 2**20
    for name in ("config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json",
                 "generation_config.json", "dflash/config.json", "dflash/model.safetensors"):
        assert (BUILTIN_MODEL / name).is_file(), name


def test_llm_without_a_model_is_the_builtin_and_auto_draft_picks_its_drafter(builtin, drafted):
    assert builtin.description.folder == BUILTIN_MODEL and builtin.proposer is None
    assert builtin.config.layers[0].attention == "full" and builtin.config.moe.shared_expert_size > 0
    assert isinstance(drafted.proposer, DFlashProposer)
    text = builtin.generate("import os\n\n\ndef ", max_tokens=48).text
    assert "(" in text and ":" in text  # Python-shaped


def test_cli_commands_default_to_the_builtin(capsys):
    assert main(["info"]) == 0
    assert "LagunaForCausalLM" in capsys.readouterr().out
    assert main(["generate", "--prompt", "def add(a, b):\n", "--max-tokens", "8", "--device", "cpu"]) == 0
    assert "tok/s" in capsys.readouterr().err


def test_builtin_compresses_held_out_code_better_than_xz(builtin):
    """bits per character on a held-out module (never trained on) against `xz -9e` on the same text."""
    path = stdlib_root() / "heapq.py"
    assert "heapq.py" in HELD_OUT and path in stdlib_files("held_out")
    text = path.read_text()
    ids = builtin.tokenizer.encode(text) + [builtin.tokenizer.eos_token_ids[0]]
    model_bpc = evaluate_bits(builtin.engine.decoder, [ids], 512) / len(text)
    xz_bpc = 8 * len(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME)) / len(text)
    print(f"heapq.py: model {model_bpc:.3f} bits/char, xz -9e {xz_bpc:.3f}")
    assert model_bpc < xz_bpc


def test_trained_drafter_is_accepted_and_lossless_on_held_out_code(builtin):
    drafted = lucebox.LLM(device="cpu", dtype="float32", draft="auto", adaptive=False)  # full blocks every round
    prompt = builtin.tokenizer.encode((stdlib_root() / "textwrap.py").read_text())[:128]
    plain = builtin.generate(prompt, max_tokens=128, ignore_eos=True)
    fast = drafted.generate(prompt, max_tokens=128, ignore_eos=True)
    assert fast.token_ids == plain.token_ids
    assert fast.stats["acceptance_length"] > 2.0  # a trained drafter: most rounds keep several drafts
    assert BUILTIN_DRAFTER.is_dir()


def test_sampling_with_the_trained_drafter_keeps_the_targets_distribution(builtin, drafted):
    """T=0.8, top-k 3: the first two tokens' exact joint law (9 outcomes, from the target's logits)
    against 800 seeded speculative samples (total variation < 0.07; sampling noise alone stays under
    about 0.05 for 9 outcomes)."""
    prompt = builtin.tokenizer.encode("def parse(line):\n    ")

    def probs(ids):
        logits = builtin.logits(ids)[-1] / 0.8
        top = torch.topk(logits, 3)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values.double(), -1).tolist(), strict=True))
    joint = {}
    for x1, p1 in probs(prompt).items():
        for x2, p2 in probs(prompt + [x1]).items():
            joint[(x1, x2)] = p1 * p2
    samples = 800
    # Three tokens: the second is decided by verifying a draft (the first comes from the prefill).
    counts = Counter(tuple(drafted.generate(prompt, max_tokens=3, temperature=0.8, top_k=3, seed=s,
                                            ignore_eos=True).token_ids[:2]) for s in range(samples))
    tv = 0.5 * sum(abs(counts.get(k, 0) / samples - p) for k, p in joint.items())
    tv += 0.5 * sum(c / samples for k, c in counts.items() if k not in joint)
    assert tv < 0.07, tv
    assert math.isclose(sum(joint.values()), 1.0)
