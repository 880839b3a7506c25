"""Greedy speculation equals plain decoding for every drafter under both KVFlash policies, on the torch
and the Triton backends (issue 42's acceptance line), filling the cells the other files leave open.

Already proven elsewhere, so not repeated here:
- torch, chains of n-gram, draft-model, self-draft and both DFlash layouts, `exact` and `select` with
  a pool smaller than the context: test_speculative.py::test_greedy_speculation_equals_plain_decoding;
- torch, draft trees under `exact` (offloaded), `select` (int8 KV) and the graphed step:
  test_tree_speculation.py::test_greedy_tree_speculation_equals_plain_decoding.

Here: DSpark on torch under both policies with the pool smaller than the context (test_dspark.py runs
it with everything resident), and every drafter under both policies on Triton. Triton runs on the CPU
through its interpreter, about a second a step, so those cases are short: a 24-token prompt and 4
tokens, at most 3 drafts a round (4 rows of a tree); the policies' own bookkeeping (kept queries,
chunk masks, rewinds of rejected rows) runs at any length, and Triton's attention over offloaded and
selected chunks is held to torch's by
test_triton_backend.py::test_triton_attention_over_the_paged_pool_and_host_chunks.
"""

from __future__ import annotations

import json

import pytest
import torch
from drafters import save_dflash, to_speculators_layout
from kernel_cases import DEVICE
from tiny_models import VOCAB

import lucebox

POLICIES = ("exact", "select")
DRAFTERS = ("ngram", "draft_model", "dflash_chain", "dflash_tree", "dspark")
# What each drafter runs as: its folder's key in `drafters` and the engine options that choose it.
RUNS = {"ngram": ("ngram", {}), "draft_model": ("draft_model", {}), "dflash_chain": ("dflash", {"tree_budget": 0}),
        "dflash_tree": ("dflash", {"tree_budget": 4}), "dspark": ("dspark", {"tree_budget": 0})}

TRITON_PROMPT = (torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5)).tolist() * 3)
TRITON_TOKENS = 4
TRITON = dict(device=DEVICE.type, dtype="float32", backend="triton", max_context=512, prefill_chunk=64, draft_k=3)
TRITON_POOLS = {"exact": 256, "select": 512}

# torch: the prompt (prefilled in a few chunks) and 24 generated tokens pass each policy's pool, so
# chunks leave for the host and `select` chooses among them.
TORCH_PROMPTS = {policy: (torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist() * 30)[:n]
                 for policy, n in (("exact", 200), ("select", 500))}
TORCH_TOKENS = 24
TORCH = dict(device="cpu", dtype="float64", backend="torch", max_context=1024, prefill_chunk=64)
TORCH_POOLS = {"exact": 192, "select": 512}


@pytest.fixture(scope="module")
def drafters(laguna, reference_models, tmp_path_factory):
    target_cfg = json.loads((laguna / "config.json").read_text())
    root = tmp_path_factory.mktemp("drafters")
    spark = save_dflash(root / "dspark", target_cfg, "zlab", target_layer_ids=(0, 2), scale=0.3)
    return {"ngram": "ngram", "draft_model": str(reference_models("llama")[0]),
            "dflash": str(save_dflash(root / "dflash", target_cfg, "zlab")),
            "dspark": str(to_speculators_layout(spark, "dspark"))}


def _speculate(laguna, drafters, drafter: str, prompt: list[int], tokens: int, **options):
    folder, choice = RUNS[drafter]
    llm = lucebox.LLM(laguna, draft=drafters[folder], adaptive=False, **choice, **options)
    if drafter.startswith(("dflash", "dspark")):
        llm.proposer.lookup = None  # the drafter's own drafts, not prompt-lookup copies
    return llm.generate(prompt, max_tokens=tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def triton_plain(laguna):
    return {policy: lucebox.LLM(laguna, draft=None, kv_policy=policy, kv_pool_tokens=pool, **TRITON)
            .generate(TRITON_PROMPT, max_tokens=TRITON_TOKENS, ignore_eos=True).token_ids
            for policy, pool in TRITON_POOLS.items()}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_speculation_equals_plain_decoding_on_triton(laguna, drafters, triton_plain, drafter, policy):
    out = _speculate(laguna, drafters, drafter, TRITON_PROMPT, TRITON_TOKENS, kv_policy=policy,
                     kv_pool_tokens=TRITON_POOLS[policy], **TRITON)
    assert out.token_ids == triton_plain[policy]
    assert max(out.stats["width_histogram"]) > 0  # drafts were verified, not only plain steps
    if drafter == "dflash_tree":
        assert max(out.stats["width_histogram"]) > 1


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_dspark_speculation_equals_plain_decoding_with_chunks_on_the_host(laguna, drafters, policy):
    options, prompt = dict(kv_policy=policy, kv_pool_tokens=TORCH_POOLS[policy], **TORCH), TORCH_PROMPTS[policy]
    plain_llm = lucebox.LLM(laguna, draft=None, **options)
    plain = plain_llm.generate(prompt, max_tokens=TORCH_TOKENS, ignore_eos=True)
    assert plain_llm.memory()["kv_host"] > 0  # the context passed the device pool: chunks live on the host
    out = _speculate(laguna, drafters, "dspark", prompt, TORCH_TOKENS, **options)
    assert out.token_ids == plain.token_ids
    assert max(out.stats["width_histogram"]) > 1  # rounds of several drafts were verified
