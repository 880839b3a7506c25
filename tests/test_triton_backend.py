"""The whole engine on the Triton kernels (the interpreter on the CPU) against the torch references."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from conftest import EXAMPLES
from kernel_cases import DEVICE
from lucebox.kernels import delta_rule_triton
from lucebox.kernels.backend import resolve_backend
from lucebox.kernels.quant import QuantizedTensor
from tiny_models import VOCAB

import lucebox
import lucebox.memory.plan
from lucebox.caches.recurrent import RecurrentState
from lucebox.errors import BackendError, InvalidArgumentError

PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def _pair(folder, **options):
    return (lucebox.LLM(folder, device=DEVICE.type, dtype="float32", backend="torch", **options),
            lucebox.LLM(folder, device=DEVICE.type, dtype="float32", backend="triton", **options))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_triton_engine_matches_the_torch_engine(reference_models, quantization):
    """Laguna-shaped model (YaRN partial rotary, gating, sliding rings, MoE with a shared expert):
    logits within 1e-3, and the same greedy tokens where the logits' margins are clear. Quantized,
    both hold the int8 LM head (Triton's choice for quantized weights), so its kernel is compared too."""
    folder, _ = reference_models("laguna")
    torch_llm, triton_llm = _pair(folder, quantization=quantization, lm_head="int8" if quantization else "auto")
    assert triton_llm.setup.backend == "triton" and torch_llm.setup.backend == "torch"
    if quantization:
        assert isinstance(triton_llm.engine.decoder.w["layers.1.experts_gate_up"], QuantizedTensor)
        assert isinstance(triton_llm.engine.decoder.w["lm_head"], QuantizedTensor)
    _assert_same_greedy_tokens_and_close_logits(torch_llm, triton_llm, PROMPT, 10)


def _assert_same_greedy_tokens_and_close_logits(torch_llm, triton_llm, prompt: list[int], n: int):
    want = torch_llm.generate(prompt, max_tokens=n, ignore_eos=True).token_ids
    got = triton_llm.generate(prompt, max_tokens=n, ignore_eos=True)
    reference = torch_llm.logits(prompt + want)
    logits = triton_llm.logits(prompt + want)
    error = _relative(logits, reference)
    assert error < 1e-3
    top2 = reference[len(prompt) - 1 : -1].topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]) / reference.abs().max()
    assert margins.min() > 10 * error  # every greedy choice is clear of the kernels' rounding
    assert got.token_ids == want
    return got


def test_triton_gated_deltanet_engine_matches_the_torch_engine(reference_models):
    """Qwen3-Next-shaped hybrid: its Gated DeltaNet layers' conv and delta rule on Triton over
    prefill chunks and n-gram verify steps (each row's state kept, rejected rows rolled back)."""
    folder, _ = reference_models("qwen3_next")
    torch_llm, triton_llm = _pair(folder, prefill_chunk=16, draft="ngram", adaptive=False)
    rows = []  # (rows, every_row) of each Triton delta-rule launch

    def spy(q, *args):
        rows.append((q.shape[0], args[-1]))
        return delta_rule_triton.recurrent_gated_delta_rule(q, *args)

    kernels = triton_llm.engine.decoder.kernels
    assert kernels.causal_conv1d is delta_rule_triton.causal_conv1d
    triton_llm.engine.decoder.kernels = dataclasses.replace(kernels, recurrent_gated_delta_rule=spy)
    prompt = (PROMPT[:8] * 3)[:20]  # repeats, so the n-gram drafter proposes
    out = _assert_same_greedy_tokens_and_close_logits(torch_llm, triton_llm, prompt, 8)
    assert any(count > 1 and every_row for count, every_row in rows)  # verify steps of several rows
    assert out.stats["width_histogram"].get(0, 0) < out.stats["rounds"]
    # The states the decode left (tokens alone hardly see a tiny model's recurrent state).
    caches = [llm.session.cache.layers for llm in (torch_llm, triton_llm)]
    assert caches[0][0].rows == caches[1][0].rows > len(prompt)
    newest = torch.tensor([caches[0][0].rows])
    for want, got in zip(*caches, strict=True):
        if isinstance(want, RecurrentState):
            states = [layer.step_state(newest, prefill=False).current() for layer in (got, want)]
            for a, b in zip(*states, strict=True):
                assert _relative(a, b) < 1e-4


@pytest.mark.parametrize("policy,pool,length", [("exact", 192, 300), ("select", 512, 600)])
def test_triton_attention_over_the_paged_pool_and_host_chunks(reference_models, policy, pool, length):
    """A context past the device pool: resident blocks, host-streamed chunks (exact) or pinned
    chunk selection (select), and their log-sum-exp merge."""
    folder, _ = reference_models("laguna")
    # Prefill chunks as large as the pool allows: each chunk is a pass of the interpreter.
    options = dict(max_context=1024, kv_pool_tokens=pool, kv_policy=policy, prefill_chunk=64 if pool < 256 else 128)
    torch_llm, triton_llm = _pair(folder, **options)
    prompt = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    if policy == "exact":  # a prefill is exact under either policy: its logits are checked once
        assert _relative(triton_llm.logits(prompt), torch_llm.logits(prompt)) < 1e-3
    want = torch_llm.generate(prompt, max_tokens=5, ignore_eos=True)
    got = triton_llm.generate(prompt, max_tokens=5, ignore_eos=True)
    assert got.token_ids == want.token_ids


def test_speculative_verify_on_triton_is_lossless(reference_models):
    """Verify blocks of up to 16 rows (causal inside the block) through the Triton kernels."""
    folder, _ = reference_models("laguna")
    plain = lucebox.LLM(folder, device=DEVICE.type, dtype="float32", backend="triton")
    # The target drafting for itself keeps (nearly) every draft, so every round verifies 16 rows.
    spec = lucebox.LLM(folder, device=DEVICE.type, dtype="float32", backend="triton", draft=str(folder),
                       draft_k=15, adaptive=False)
    # 17 tokens: the prefill's, then one round of 15 drafts + 1.
    want = plain.generate(PROMPT, max_tokens=17, ignore_eos=True).token_ids
    result = spec.generate(PROMPT, max_tokens=17, ignore_eos=True)
    assert result.token_ids == want
    assert result.stats["width_histogram"].get(15, 0) >= 1 and result.stats["acceptance_length"] > 8


def test_backend_choice_and_its_errors(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.float32) == "torch"
    assert resolve_backend("torch", cpu, torch.float64) == "torch"
    assert resolve_backend("triton", cpu, torch.float32) == "triton"  # TRITON_INTERPRET=1 in the tests
    with pytest.raises(InvalidArgumentError, match="'cuda-graphs' is not one of auto, torch, triton"):
        resolve_backend("cuda-graphs", cpu, torch.float32)
    with pytest.raises(BackendError, match="float32, float16 or bfloat16"):
        resolve_backend("triton", cpu, torch.float64)
    with pytest.raises(BackendError, match="computes bfloat16 wrongly"):
        resolve_backend("triton", cpu, torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", cpu, torch.float32)


def test_unquantizable_shapes_and_unknown_schemes_are_refused(reference_models):
    folder, _ = reference_models("laguna")
    with pytest.raises(InvalidArgumentError, match="quantization 'int3' is not one of int8, int4"):
        lucebox.LLM(folder, device="cpu", quantization="int3")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_memory_plan_counts_quantized_weights_exactly(tmp_path, quantization):
    """What the plan reserves before loading is what the quantized weights take once loaded."""
    shutil.copytree(EXAMPLES / "laguna-tiny", tmp_path / "model")
    llm = lucebox.LLM(tmp_path / "model", device="cpu", dtype="float32", backend="torch", load_format="dummy",
                      quantization=quantization, max_context=1024)
    plain = lucebox.memory.plan.weight_bytes(llm.config, torch.float32)
    assert llm.memory()["weights"] == lucebox.memory.plan.weight_bytes(llm.config, torch.float32, quantization)
    # float32 embeddings and head stay; the linear layers shrink 4x (int8) or about 8x (int4).
    assert llm.memory()["weights"] < (0.36 if quantization == "int8" else 0.25) * plain
