"""Tree attention: each tree row sees the committed keys (at its true position) and its ancestors
alone. Triton == the torch reference; the reference == one causal query per row over exactly the
keys a chain along its path would hold; a whole tree step's logits == chain steps along each path,
over sliding rings (window 8, wrapped) and the paged pool."""

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close, random
from lucebox.kernels import attention, attention_triton
from lucebox.models.tree_mask import TreeMask
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.engine.runner import StepRunner
from lucebox.speculative.tree import build_tree

START = 90  # the tree's root position c


def small_tree(budget=9, seed=0):
    g = torch.Generator().manual_seed(seed)

    def children(depth, token):
        if depth >= 4:
            return [], []
        ids = torch.randperm(VOCAB, generator=g)[:3].tolist()
        return ids, sorted(torch.rand(3, generator=g).tolist(), reverse=True)

    return build_tree(int(torch.randint(0, VOCAB, (1,), generator=g)), budget, children)


def tree_keys(tree, S, seed):
    """A ring-like block: committed positions < START and the tree's scratch rows START + i in
    shuffled slots, some slots empty."""
    g = torch.Generator().manual_seed(seed)
    committed = torch.randperm(START, generator=g)[: S - len(tree)]
    positions = torch.cat([committed, torch.arange(START, START + len(tree))])[torch.randperm(S, generator=g)]
    positions[(torch.rand(S, generator=g) < 0.15) & (positions < START)] = -1
    return positions


def mask_of(tree, window):
    bits = torch.tensor(tree.ancestor_bits, device=DEVICE)
    depths = torch.tensor(tree.depths, device=DEVICE)
    return START + depths, TreeMask(bits, depths).bits_for(window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("splits", [None, 2])
def test_triton_tree_attention_matches_the_reference(poisoned, dtype, window, splits):
    tree = small_tree()
    T, Hq, KV, S, D = len(tree), 4, 2, 80, 16
    k_pos = tree_keys(tree, S, seed=1).to(DEVICE)
    q_pos, bits = mask_of(tree, window)
    q = random(T, Hq, D, dtype=dtype, seed=1)
    k, v = random(KV, S, D, dtype=dtype, seed=2), random(KV, S, D, dtype=dtype, seed=3)
    out, lse = attention_triton.attention_partial(q, k, v, q_pos, k_pos, 0.3, window, tree_bits=bits, splits=splits)
    want, want_lse = attention.attention_partial(q.double(), k.double(), v.double(), q_pos, k_pos, 0.3, window,
                                                 tree_bits=bits)
    assert_close(out, want, dtype)
    assert torch.allclose(lse.double(), want_lse, atol=1e-3 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_reference_tree_rows_see_what_a_chain_along_their_path_sees(window):
    tree = small_tree(seed=2)
    T, Hq, KV, S, D = len(tree), 4, 2, 60, 8
    k_pos = tree_keys(tree, S, seed=3)
    q_pos, bits = mask_of(tree, window)
    q, k, v = random(T, Hq, D, dtype=torch.float64, seed=4), random(KV, S, D, dtype=torch.float64, seed=5), \
        random(KV, S, D, dtype=torch.float64, seed=6)
    out, _ = attention.attention_partial(q, k, v, q_pos, k_pos, 0.3, window, tree_bits=bits)
    for i in range(T):
        # The chain along row i's path: committed keys as they are, the path's rows at their true positions.
        path = {START + r: START + tree.depths[r] for r in [0, *tree.path(i)]}
        keep = (k_pos < START) | torch.tensor([int(p) in path for p in k_pos])
        chain_pos = torch.tensor([path.get(int(p), int(p)) for p in k_pos])[keep]
        want, _ = attention.attention_partial(q[i : i + 1], k[:, keep], v[:, keep], q_pos[i : i + 1], chain_pos,
                                              0.3, window)
        assert torch.allclose(out[i], want[0], atol=1e-12), i


@pytest.fixture(scope="module")
def laguna_llm(reference_models):
    folder = reference_models("laguna")[0]
    return {policy: lucebox.LLM(folder, device="cpu", dtype="float64", max_context=512, kv_policy=policy,
                                kv_pool_tokens=512, prefill_chunk=64, draft=None) for policy in ("exact", "select")}


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("policy", ["exact", "select"])
def test_tree_step_logits_equal_chain_steps_along_each_path(laguna_llm, policy, graphed):
    """Prompt of 100 tokens: the window-8 rings have wrapped many times; row by row, a tree step's
    logits equal those of a plain step over [last, path...] at the same place."""
    llm = laguna_llm[policy]
    runner = StepRunner(llm.engine.decoder, graphs=graphed, capture=False)
    prompt = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    cache = llm.engine.new_cache()
    for _ in llm.engine.prefill(prompt[:-1], cache):
        pass
    c = cache.length
    tree = small_tree(budget=12, seed=int(graphed))
    tree = type(tree)([prompt[-1], *tree.tokens[1:]], tree.parents, tree.depths, tree.probabilities)
    got = runner.step(tree.tokens, Step.span(c, len(tree), llm.engine.decoder.device), cache, (), tree).logits.clone()
    assert graphed == bool(runner.widths)
    for i in range(len(tree)):
        cache.rollback(c)
        rows = [tree.tokens[r] for r in [0, *tree.path(i)]]
        want = runner.step(rows, Step.span(c, len(rows), llm.engine.decoder.device), cache).logits[-1]
        # RoPE angles are float32 (as the references compute them), and their vectorized cos/sin can
        # differ by an ulp with a row's place in the step: chain steps of two widths differ by ~5e-8 too.
        assert torch.allclose(got[i], want, rtol=0, atol=1e-6), (i, float((got[i] - want).abs().max()))
