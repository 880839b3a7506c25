"""Monte Carlo through the real engine: speculating with a disagreeing draft model, the first three
sampled tokens follow the target's exact joint distribution (total variation < 0.03)."""

import itertools
from collections import Counter

import pytest
import torch

import lucebox

V, PROMPT, SAMPLES = 8, [1, 5, 2], 4000


def tiny_llama(folder, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                         initializer_range=1.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mc")
    return tiny_llama(root / "target", 1), tiny_llama(root / "draft", 2)


def exact_joint(llm):
    joint = {}
    for x1, x2 in itertools.product(range(V), repeat=2):
        probs = llm.logits(PROMPT + [x1, x2]).softmax(-1)
        p1, p2, p3 = probs[len(PROMPT) - 1], probs[len(PROMPT)], probs[len(PROMPT) + 1]
        for x3 in range(V):
            joint[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x3])
    return joint


# Plain sampled decoding is covered too: coupled speculation commits its very tokens
# (test_speculative.py::test_coupled_sampling_commits_what_plain_sampling_commits), and
# test_verify.py enumerates the tokenwise rule exactly (its engine path is block's).
@pytest.mark.parametrize("rule", ["coupled", "block"])
def test_first_three_tokens_follow_the_target(models, rule):
    target, drafter = models
    # adaptive=False: every round drafts (the clock would find this draft model not worth its cost).
    llm = lucebox.LLM(target, device="cpu", dtype="float64", draft=drafter, verify=rule,
                      adaptive=False)
    joint = exact_joint(llm)
    counts, kept = Counter(), 0
    for s in range(SAMPLES):
        out = llm.generate(PROMPT, max_tokens=3, temperature=1.0, seed=s, ignore_eos=True)
        counts[tuple(out.token_ids)] += 1
        kept += sum(n * c for n, c in out.stats["accepted_histogram"].items())
    tv = 0.5 * sum(abs(counts.get(seq, 0) / SAMPLES - p) for seq, p in joint.items())
    print(f"verify={rule}: total variation {tv:.4f} over {SAMPLES} samples")
    assert tv < 0.03
    assert kept > SAMPLES / 10  # drafts were verified and often kept, not skipped
