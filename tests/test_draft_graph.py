"""The DFlash drafter's block pass as a graph (`speculative.draft_graph`): its body, run eagerly as
on the CPU (`capture=False`), drafts what the eager pass drafts over the same rings, and an
engine whose drafter and steps take their graphed bodies, captured at start-up, decodes as plain
decoding does. Both drafter layouts: z-lab (non-causal blocks) and Laguna (causal, windowed)."""

import json

import pytest
import torch
from drafters import save_dflash
from kernel_cases import no_host_sync
from tiny_models import VOCAB

import lucebox
from lucebox.engine.runner import StepRunner

PROMPT = (torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(2)).tolist() * 3)[:40]
COMMON = dict(device="cpu", dtype="float64", max_context=256, prefill_chunk=32)


@pytest.fixture(scope="module")
def laguna(reference_models):
    return reference_models("laguna")[0]


@pytest.mark.parametrize("layout", ["zlab", "laguna"])
def test_the_graphed_block_pass_drafts_as_the_eager_one_and_decoding_stays_plain(laguna, layout, tmp_path):
    target_cfg = json.loads((laguna / "config.json").read_text())
    drafter = save_dflash(tmp_path / layout, target_cfg, layout)
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, max_tokens=40, ignore_eos=True).token_ids
    # A ring of 48 slots: the request wraps it, and a graphed pass reads every slot.
    llm = lucebox.LLM(laguna, draft=str(drafter), adaptive=False, tree_budget=0, draft_ctx=48, **COMMON)
    proposer = llm.proposer
    proposer.lookup = None  # every draft from the drafter's own pass
    llm.engine.runner = StepRunner(llm.decoder, graphs=True, capture=False)
    proposer.graph_with(capture=False)
    llm.session.capture_graphs()  # the drafter's pass too, over its empty rings
    out = llm.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert out.token_ids == plain and proposer.graph.out is not None
    context = PROMPT + out.token_ids[:-1]  # the rings now hold the request's rows
    graphed_logits, graphed_hidden = (t.clone() for t in proposer.block_pass(context, 5))
    with no_host_sync():  # what a capture records waits for nothing
        proposer.graph.body()
    graph, proposer.graph = proposer.graph, None
    logits, hidden = proposer.block_pass(context, 5)
    assert torch.allclose(graphed_hidden, hidden, rtol=0, atol=1e-12)
    assert torch.allclose(graphed_logits, logits, rtol=0, atol=1e-10)
    assert graph.inputs[1].tolist() == list(range(len(context) - 1, len(context) - 1 + graph.inputs.shape[1]))
    rings = [(ring.k, ring.positions) for ring in proposer.rings]
    proposer.start(PROMPT[:4], None)  # the next request empties the same rings (the graph reads them by address)
    assert [(ring.k, ring.positions) for ring in proposer.rings] == rings
    assert all((ring.positions == -1).all() for ring in proposer.rings)
