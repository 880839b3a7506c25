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


@pytest.mark.parametrize("layout", ["zlab", "laguna"])
def test_the_graphed_block_pass_drafts_as_the_eager_one_and_decoding_stays_plain(laguna, layout, tmp_path):
    target_cfg = json.loads((laguna / "config.json").read_text())
    drafter = save_dflash(tmp_path / layout, target_cfg, layout)
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, max_tokens=40, ignore_eos=True).token_ids
    # A ring of 48 slots: the request wraps it, and a graphed pass reads every slot.
    llm = lucebox.LLM(laguna, draft=str(drafter), adaptive=False, tree_budget=0, draft_ctx=48, **COMMON)
    proposer = llm.proposer
    proposer.lookup = None  # every draft from the drafter's own pass
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
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


@pytest.mark.parametrize("layout", ["zlab", "laguna"])
def test_a_non_causal_block_lets_every_row_see_every_row(laguna, layout, tmp_path):
    """z-lab blocks are non-causal: a row's hidden state follows the rows after it; Laguna's drafter
    is causal: it does not."""
    target_cfg = json.loads((laguna / "config.json").read_text())
    llm = lucebox.LLM(laguna, draft=str(save_dflash(tmp_path / layout, target_cfg, layout)), adaptive=False, **COMMON)
    proposer = llm.proposer
    proposer.start(PROMPT, None)
    block = torch.full((proposer.drafter.cfg.block_size,), proposer.drafter.cfg.mask_token_id)
    positions = torch.arange(10, 10 + len(block))
    before = proposer.block_forward(block, positions, 5)[1]
    block[5] = 7  # the sixth row's token: its hidden state is row 4 of the k drafted rows after the first
    after = proposer.block_forward(block, positions, 5)[1]
    assert not torch.equal(after[4], before[4])
    assert torch.equal(after[0], before[0]) == (layout == "laguna")
