"""Decode/verify steps through the runner's graphed path equal the plain (eager) forward.

On the CPU the graphed path runs its step body eagerly (no capture), which checks everything but
the capture itself: static inputs, the caches' reserve/store split, their static blocks (whole
rings, the whole pool with its device tables), the step's own argmax, captured features. On a
GPU the same checks run with real graph capture and replay."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import EXAMPLES
from drafters import save_dflash
from kernel_cases import no_host_sync
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.engine.runner import StepGraph, StepRunner
from lucebox.errors import InvalidArgumentError
from lucebox.limits import DECODE_ROWS

PROMPT = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(4)).tolist()
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("kv", ["exact", "select-offload", "select-offload-int8"])
def test_graphed_steps_equal_the_plain_forward(reference_models, kv):
    """Plain decoding and verify blocks of 1 + 6 drafts; `select` with a pool smaller than the
    context (chunks leave for the host, re-selection between steps), also with int8 K/V."""
    folder, _ = reference_models("laguna")
    options = dict(device="cpu", dtype="float64")
    if kv.startswith("select-offload"):
        options.update(max_context=1280, kv_pool_tokens=640, kv_policy="select", prefill_chunk=128)
    if kv.endswith("int8"):
        options.update(kv_dtype="int8")
    prompt = PROMPT * (32 if kv.startswith("select-offload") else 1)  # 960 tokens: past the pool
    plain = lucebox.LLM(folder, **options)
    graphed = lucebox.LLM(folder, draft=str(folder), draft_k=6, adaptive=False, **options)
    graphed.engine.runner = StepRunner(graphed.engine.decoder, graphs=True, capture=False)
    want = plain.generate(prompt, max_tokens=70, ignore_eos=True).token_ids
    got = graphed.generate(prompt, max_tokens=70, ignore_eos=True)
    assert got.token_ids == want
    assert {w for w, *_ in graphed.engine.runner.widths} >= {7}  # verify blocks of 1 + 6 drafts ran through it
    plain.engine.runner = StepRunner(plain.engine.decoder, graphs=True, capture=False)
    assert plain.generate(prompt, max_tokens=70, ignore_eos=True).token_ids == want
    assert {w for w, *_ in plain.engine.runner.widths} == {1}


def test_graphed_hybrid_steps_equal_the_plain_forward(reference_models):
    """Gated DeltaNet layers in the graphed step: verify blocks of 1 + 6 drafts from a draft model,
    rejected drafts rolled back to the accepted row's state slot."""
    folder, drafter = reference_models("qwen3_next")[0], reference_models("llama")[0]
    options = dict(device="cpu", dtype="float64")
    want = lucebox.LLM(folder, **options).generate(PROMPT, max_tokens=40, ignore_eos=True).token_ids
    graphed = lucebox.LLM(folder, draft=str(drafter), draft_k=6, adaptive=False, **options)
    graphed.engine.runner = StepRunner(graphed.engine.decoder, graphs=True, capture=False)
    got = graphed.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert got.token_ids == want and any(a < 1 for a in got.stats["acceptance_by_position"])
    assert {w for w, *_ in graphed.engine.runner.widths} >= {7}


def test_cuda_graphs_need_cuda_and_triton(reference_models):
    folder, _ = reference_models("laguna")
    with pytest.raises(InvalidArgumentError, match="cuda_graphs=True needs device='cuda'"):
        lucebox.LLM(folder, device="cpu", cuda_graphs=True)
    assert lucebox.LLM(folder, device="cpu").engine.runner.graphs is False


def laguna_tiny(tmp_path, dtype: str, capture: bool = True, **options) -> lucebox.LLM:
    """Random weights at examples/laguna-tiny's shapes (no transformers needed on the GPU
    machine), replaying captured graphs or running the same step body eagerly."""
    folder = tmp_path / "laguna-tiny"
    if not folder.exists():
        shutil.copytree(EXAMPLES / "laguna-tiny", folder)
    llm = lucebox.LLM(folder, device="cuda", dtype=dtype, backend="triton", load_format="dummy", cuda_graphs=True,
                      **{"max_context": 2048, **options})
    if not capture:
        llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    return llm


SELECT_OFFLOAD = dict(max_context=1280, kv_pool_tokens=640, kv_policy="select")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv", ["exact", "select-offload", "select-offload-int8"])
def test_replayed_graphs_equal_the_uncaptured_step_on_cuda(tmp_path, dtype, kv):
    """The same kernels, replayed from graphs captured once per width, give the same tokens at
    every position (select-offload: chunks leave the pool and re-selection runs between graphs)."""
    options = {"exact": {}, "select-offload": SELECT_OFFLOAD,
               "select-offload-int8": dict(SELECT_OFFLOAD, kv_dtype="int8")}[kv]
    uncaptured = laguna_tiny(tmp_path, dtype, capture=False, **options)
    graphed = laguna_tiny(tmp_path, dtype, **options)
    prompt = PROMPT * (32 if kv.startswith("select-offload") else 1)
    want = uncaptured.generate(prompt, max_tokens=100, ignore_eos=True).token_ids
    assert graphed.generate(prompt, max_tokens=100, ignore_eos=True).token_ids == want
    speculative = laguna_tiny(tmp_path, dtype, draft="ngram", draft_k=7, adaptive=False, **options)
    repetitive = prompt[:10] * 3  # n-gram drafts on every round, so verify widths > 1 run from graphs
    if dtype == "float32":  # a verify block rounds differently from single rows: compare where rounding is small
        assert (speculative.generate(repetitive, max_tokens=40, ignore_eos=True).token_ids
                == uncaptured.generate(repetitive, max_tokens=40, ignore_eos=True).token_ids)
        assert len(speculative.engine.runner.widths) >= 2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_every_width_replays_the_uncaptured_steps_logits_on_cuda(tmp_path):
    """Widths 1..16, each captured at one position and replayed at two later ones (a pool chunk
    boundary in between), against the same body run eagerly: identical logits."""
    engines = [laguna_tiny(tmp_path, "float32"), laguna_tiny(tmp_path, "float32", capture=False)]
    caches = []
    for llm in engines:
        cache = llm.engine.new_cache()
        for _ in llm.engine.prefill(PROMPT, cache):
            pass
        caches.append(cache)
    position = len(PROMPT)
    for _ in range(3):
        for width in range(1, DECODE_ROWS + 1):
            rows = [(position * 31 + i * 7) % VOCAB for i in range(width)]
            outs = [llm.engine.runner.step(rows, Step.span(position, width, llm.device), cache)
                    for llm, cache in zip(engines, caches, strict=True)]
            assert torch.equal(outs[0].logits, outs[1].logits), (width, position)
            for cache in caches:  # a verify that kept its first row
                cache.commit(position + 1)
                cache.rollback(position + 1)
            position += 1
    assert {w for w, *_ in engines[0].engine.runner.widths} == set(range(1, DECODE_ROWS + 1))
    assert len({graph.pool for graph in engines[0].engine.runner.widths.values()}) == 1  # one memory pool for all


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_drafters_replayed_block_pass_equals_its_eager_pass_on_cuda(tmp_path):
    """The DFlash drafter's pass, captured at start-up with the steps (one memory pool), replays what
    the same pass computes eagerly over the same rings, and speculation stays plain decoding."""
    target_cfg = json.loads((EXAMPLES / "laguna-tiny" / "config.json").read_text())
    drafter = save_dflash(tmp_path / "drafter", target_cfg, "laguna")
    plain = laguna_tiny(tmp_path, "float32").generate(PROMPT, max_tokens=40, ignore_eos=True).token_ids
    llm = laguna_tiny(tmp_path, "float32", draft=str(drafter), adaptive=False, tree_budget=0)
    proposer = llm.proposer
    proposer.lookup = None
    assert proposer.graph.graph is not None and proposer.graph.pool is llm.engine.runner.pool  # captured when opened
    out = llm.generate(PROMPT, max_tokens=40, ignore_eos=True)
    assert out.token_ids == plain
    context = PROMPT + out.token_ids[:-1]
    replayed = [t.clone() for t in proposer.block_pass(context, 5)]
    graph, proposer.graph = proposer.graph, None
    eager = proposer.block_pass(context, 5)
    proposer.graph = graph
    for a, b in zip(replayed, eager, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["laguna", "qwen3_next"])
def test_the_graphed_step_never_syncs_with_the_host(reference_models, arch):
    """What a graph captures (embed, norms, projections, RoPE, cache stores, attention over the
    static blocks, gate, routing, MoE with a shared expert, LM head, argmax; Gated DeltaNet's conv,
    delta rule and state slots; Triton kernels through the interpreter) calls nothing that waits
    for the device."""
    folder, _ = reference_models(arch)
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", backend="triton", max_context=1024,
                      kv_pool_tokens=640, kv_policy="select")
    cache = llm.engine.new_cache()
    llm.engine.runner.step(PROMPT, Step.span(0, len(PROMPT), llm.device, prefill=True), cache)
    cache.commit(len(PROMPT))
    step = Step.span(len(PROMPT), 5, llm.device)
    for layer in cache.layers:
        layer.reserve(step)
    graph = StepGraph(llm.engine.decoder, cache, width=5, layers=(), capture=False)
    graph.inputs.copy_(torch.stack([torch.tensor(PROMPT[:5]), step.positions]))
    with no_host_sync():
        out = graph.body()
    assert out.logits.shape == (5, llm.config.vocab_size) and out.choices.shape == (5,)


def test_graphs_follow_the_session_cache_and_let_dropped_ones_go(reference_models):
    """Graphs read their cache by address, so the engine keeps one cache for them: the start-up
    cache (where the adaptive width timed its steps) serves the first request, a new conversation
    empties and reuses it, and a dropped cache is no longer held by the runner."""
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", draft="ngram")
    cache = llm.session.cache
    assert llm.engine.runner._bound is cache and not cache.dirty  # timed at start-up, left clean
    llm.generate(PROMPT, max_tokens=4, ignore_eos=True)
    llm.generate(PROMPT[::-1], max_tokens=4, ignore_eos=True)  # shares nothing: emptied, not replaced
    assert llm.session.cache is cache and llm.engine.runner._bound is cache
    llm.drop_cache()
    assert llm.engine.runner._bound is None
    llm.generate(PROMPT, max_tokens=4, ignore_eos=True)
    assert llm.engine.runner._bound is llm.session.cache is not cache
