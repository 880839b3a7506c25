"""int8 K/V (`kv_dtype="int8"`): each stored value within max|row| / 254 of the float one, host
copies holding the same codes, the Triton kernel equal to the reference on int8 blocks, host
memory near half of bfloat16's, and the logit error it causes within its documented bound."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import random
from lucebox.kernels import attention, attention_triton
from lucebox.kernels.kv_int8 import dequantize_rows, quantize_rows

import lucebox

PROMPT = torch.randint(0, 120, (300,), generator=torch.Generator().manual_seed(0)).tolist()


def test_each_value_is_within_half_a_step_of_its_row_maximum():
    x = torch.randn(64, 4, 32, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None, None]
    x[3, 1] = 0.0  # a row of zeros stays zeros
    codes, scales = quantize_rows(x)
    back = dequantize_rows(codes, scales, torch.float64)
    bound = x.abs().amax(-1, keepdim=True) / 254
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[3, 1], x[3, 1])
    peaks = x.abs().argmax(-1, keepdim=True)  # the largest value of a row is exact (to the float32 scale)
    torch.testing.assert_close(back.gather(-1, peaks), x.gather(-1, peaks), rtol=3e-7, atol=0)


def test_a_row_holding_inf_or_nan_dequantizes_to_nan_not_to_finite_values():
    """As the float row would, it poisons attention (and the engine's non-finite check) instead
    of passing for plausible keys."""
    x = torch.randn(3, 8, dtype=torch.float32)
    x[0, 2], x[1, 5] = float("inf"), float("nan")
    back = dequantize_rows(*quantize_rows(x), torch.float32)
    assert back[:2].isnan().all() and torch.isfinite(back[2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_kernel_reads_int8_blocks_like_the_reference(dtype):
    T, Hq, KV, S, D = 3, 4, 2, 150, 32
    q = random(T, Hq, D, dtype=dtype, seed=1)
    k_codes, k_scale = quantize_rows(random(KV, S, D, dtype=torch.float32, seed=2))
    v_codes, v_scale = quantize_rows(random(KV, S, D, dtype=torch.float32, seed=3))
    positions = torch.arange(S)
    args = (q, k_codes, v_codes, positions[-T:], positions, D**-0.5)
    want, want_lse = attention.attention_partial(*args, k_scale=k_scale, v_scale=v_scale)
    got, got_lse = attention_triton.attention_partial(*args, k_scale=k_scale, v_scale=v_scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_lse, want_lse.float(), rtol=tol, atol=tol)
    # and the reference is attention over the dequantized rows
    plain, _ = attention.attention_partial(q, dequantize_rows(k_codes, k_scale, dtype),
                                           dequantize_rows(v_codes, v_scale, dtype), positions[-T:], positions, D**-0.5)
    torch.testing.assert_close(want, plain, rtol=0, atol=0)


def _pair(folder, **options):
    options = dict(device="cpu", dtype="float64", max_context=1024, **options)
    return lucebox.LLM(folder, **options), lucebox.LLM(folder, kv_dtype="int8", **options)


# Offloaded with each policy: the pool holds 512 of the prompt's 300 + decoded rows only with
# `exact` streaming; `select` attends to a subset. Error bound: see README, "Long contexts".
@pytest.mark.parametrize("policy", ["exact", "select"])
def test_int8_kv_logit_error_on_a_dense_model_is_within_its_bound(reference_models, policy):
    folder, _ = reference_models("qwen3")
    plain, int8 = _pair(folder, kv_pool_tokens=512, kv_policy=policy, prefill_chunk=64)
    want, got = plain.logits(PROMPT), int8.logits(PROMPT)
    error = (got - want).abs().max() / want.abs().max()
    assert 0 < error < 0.02  # measured 0.0063 on this model
    assert int8.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids == \
        plain.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids


def test_chunks_come_back_from_the_host_unchanged(reference_models):
    """A pool far smaller than the context: chunks leave and return, and the decode that reads
    them equals one whose pool holds everything (both int8)."""
    folder, _ = reference_models("qwen3")
    prompt = PROMPT * 2
    options = dict(device="cpu", dtype="float64", max_context=1024, kv_dtype="int8", kv_policy="exact",
                   prefill_chunk=64)
    roomy = lucebox.LLM(folder, **options).generate(prompt, max_tokens=6, ignore_eos=True)
    tight = lucebox.LLM(folder, kv_pool_tokens=256, **options)
    out = tight.generate(prompt, max_tokens=6, ignore_eos=True)
    assert out.token_ids == roomy.token_ids
    assert tight.memory()["kv_host"] > 0


def test_host_kv_takes_about_half_the_bytes_of_bfloat16(reference_models):
    folder, _ = reference_models("qwen3")
    options = dict(device="cpu", dtype="bfloat16", max_context=2048, kv_pool_tokens=256, kv_policy="exact",
                   prefill_chunk=64)
    bf16 = lucebox.LLM(folder, **options)
    int8 = lucebox.LLM(folder, kv_dtype="int8", **options)
    for llm in (bf16, int8):
        llm.generate(PROMPT * 3, max_tokens=2, ignore_eos=True)
    D = bf16.config.head_dim
    ratio = int8.memory()["kv_host"] / bf16.memory()["kv_host"]
    assert ratio == pytest.approx((D + 4) / (2 * D))  # a byte per value and a float32 scale per row
    assert int8.memory()["kv_pool_device"] / bf16.memory()["kv_pool_device"] == pytest.approx((D + 4) / (2 * D))


def test_kv_dtype_is_checked(reference_models):
    folder, _ = reference_models("qwen3")
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="kv_dtype"):
        lucebox.LLM(folder, device="cpu", kv_dtype="int4")
