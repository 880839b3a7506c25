"""Tree speculation through the real engine: greedy output with draft trees equals plain greedy
decoding token for token, across sliding-ring wraps (window 8), a KVFlash pool smaller than the
context (chunks on the host), `select`, int8 KV and the graphed step body (capture=False)."""

import json

import pytest
import torch
from drafters import save_dflash
from tiny_models import VOCAB

import lucebox
from lucebox.caches import SequenceCache
from lucebox.engine.runner import StepRunner
from lucebox.speculative.tree import build_tree

PROMPT = (torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist() * 4)[:70]
N = 150  # 220 tokens: past the 192-token pool, and the window of 8 many times over
COMMON = dict(device="cpu", dtype="float64", max_context=512, prefill_chunk=64)
CASES = {
    "exact-offload": dict(kv_policy="exact", kv_pool_tokens=192),
    "select-int8": dict(kv_policy="select", kv_pool_tokens=512, kv_dtype="int8"),
    "select-graphed": dict(kv_policy="select", kv_pool_tokens=512),
}


@pytest.fixture(scope="module")
def dflash(laguna, tmp_path_factory):
    target_cfg = json.loads((laguna / "config.json").read_text())
    return save_dflash(tmp_path_factory.mktemp("drafter") / "zlab", target_cfg, "zlab")


def oracle_trees(llm, truth: list[int], prompt_len: int, seed: int = 0) -> None:
    """Make the drafter's trees hold the plain greedy continuation as one branch among decoys,
    ranked second among its siblings (so accepted rows are rarely in place and must move), and
    missing at random (so paths end at every depth)."""
    rng = torch.Generator().manual_seed(seed)
    proposer = llm.proposer

    def propose_tree(context, budget, *_sampling):
        proposer.block_pass(context, 1)  # the drafter's own pass still runs (its rings are read)
        ahead = truth[len(context) - prompt_len:]  # the tokens plain decoding commits next

        def children(depth, token):
            if depth >= proposer.max_width:
                return [], []
            decoys = torch.randint(0, VOCAB, (2,), generator=rng).tolist()
            on_path = depth == 0 or (depth <= len(ahead) and token == ahead[depth - 1])
            keep = float(torch.rand((), generator=rng)) > 0.15
            if on_path and depth < len(ahead) and keep and ahead[depth] not in decoys:
                return [decoys[0], ahead[depth], decoys[1]], [0.5, 0.4, 0.1]
            return decoys[:1] if decoys[0] == decoys[1] else decoys, [0.3, 0.2][: len(set(decoys))]

        return build_tree(context[-1], budget, children)

    proposer.propose_tree = propose_tree


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tree_speculation_equals_plain_decoding(laguna, dflash, case, monkeypatch):
    options = {**COMMON, **CASES[case]}
    plain = lucebox.LLM(laguna, draft=None, **options).generate(PROMPT, max_tokens=N, ignore_eos=True).token_ids
    llm = lucebox.LLM(laguna, draft=dflash, adaptive=False, tree_budget=15, **options)
    if case.endswith("graphed"):
        llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
        llm.session.capture_graphs()  # what opening does on a GPU: every graph, the trees' too
        captured = set(llm.engine.runner.widths)
    oracle_trees(llm, plain, len(PROMPT))
    paths = []
    accept_path = SequenceCache.accept_path

    def recorded(cache, start, rows):
        paths.append(rows)
        accept_path(cache, start, rows)

    monkeypatch.setattr(SequenceCache, "accept_path", recorded)
    out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert out.token_ids == plain
    stats = out.stats
    assert stats["acceptance_length"] > 2  # long paths were accepted, from trees of up to 15 rows
    assert max(stats["width_histogram"]) == 15
    assert sum(rows != list(range(1, len(rows) + 1)) for rows in paths) > 10  # rows moved into place
    if case.endswith("graphed"):
        assert any(tree for _, _, tree in llm.engine.runner.widths)  # tree steps ran through the graphed body
        assert set(llm.engine.runner.widths) == captured  # and no step waited for a graph of its own


def test_greedy_trees_of_the_drafter_itself_equal_plain_decoding(laguna, dflash):
    """The DFlash drafter's own top-k trees (random weights: mostly rejected) stay lossless."""
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, max_tokens=60, ignore_eos=True).token_ids
    llm = lucebox.LLM(laguna, draft=dflash, adaptive=False, tree_budget=6, **COMMON)
    out = llm.generate(PROMPT, max_tokens=60, ignore_eos=True)
    assert out.token_ids == plain
    assert max(out.stats["width_histogram"]) == 6


def test_greedy_trees_under_a_repetition_penalty_equal_plain_decoding(laguna, dflash):
    """Each tree row is penalized by its own path's tokens, as plain decoding would by then."""
    options = dict(max_tokens=60, ignore_eos=True, repetition_penalty=1.3)
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, **options).token_ids
    llm = lucebox.LLM(laguna, draft=dflash, adaptive=False, tree_budget=8, **COMMON)
    oracle_trees(llm, plain, len(PROMPT))
    out = llm.generate(PROMPT, **options)
    assert out.token_ids == plain and out.stats["acceptance_length"] > 2


def test_coupled_sampled_trees_commit_what_plain_sampling_commits(laguna, dflash):
    """Each tree row picks by the race at its own depth's position (the default "coupled" rule):
    trees holding plain sampled decoding's next tokens at random depths and ranks keep them, and
    the output is plain sampled decoding's, token for token."""
    options = dict(max_tokens=60, ignore_eos=True, temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=3)
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, **options).token_ids
    llm = lucebox.LLM(laguna, draft=dflash, adaptive=False, tree_budget=8, **COMMON)
    oracle_trees(llm, plain, len(PROMPT))
    out = llm.generate(PROMPT, **options)
    assert out.token_ids == plain and out.stats["acceptance_length"] > 2


def test_adaptive_rounds_mixing_chains_and_trees_equal_plain_decoding(laguna, dflash):
    """The default engine takes chain or tree rounds by the rates each delivered (both are tried):
    output stays plain decoding's, and tree rounds moved accepted rows."""
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, max_tokens=N, ignore_eos=True).token_ids
    llm = lucebox.LLM(laguna, draft=dflash, **COMMON)
    oracle_trees(llm, plain, len(PROMPT))
    out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert out.token_ids == plain
    counts = llm.engine.learned.shapes["greedy"].counts
    assert counts["chain"] > 0 and counts["tree"] > 0
