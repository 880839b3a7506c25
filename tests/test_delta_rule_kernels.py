"""The Gated DeltaNet kernels in Triton against their torch references (`kernels/delta_rule.py`),
from a nonzero start state, keeping the last row's state or every row's; on the CPU through
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, DTYPES, assert_close, random
from lucebox.kernels import delta_rule, delta_rule_triton

from lucebox.errors import InvalidArgumentError


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("T,C,K", [(1, 24, 4), (19, 130, 4), (3, 10, 2)])  # decode; two tiles each way; K = 2
def test_causal_conv_matches_the_reference(poisoned, dtype, every_row, T, C, K):
    x, weight, state = random(T, C, dtype=dtype, seed=1), random(C, K, dtype=dtype, seed=2), random(K - 1, C, seed=3)
    out, after = delta_rule_triton.causal_conv1d(x, weight, state, every_row)
    want, _ = delta_rule.causal_conv1d(x.double(), weight.double(), state.to(dtype).double(), every_row)
    assert_close(out, want, dtype)
    assert out.dtype == dtype
    # The states are the inputs themselves, moved: exactly the reference's, in x's dtype.
    assert torch.equal(after, delta_rule.causal_conv1d(x, weight, state, every_row)[1])


def _delta_rule_inputs(T, H, Dk, Dv, dtype, per_key=False):
    """q, k (l2-normed), v, g (log decay <= 0), beta in (0, 1) in `dtype`, and a float32 start state."""
    g_shape = (T, H, Dk) if per_key else (T, H)
    gen = torch.Generator().manual_seed(T * 100 + Dk)
    q = random(T, H, Dk, dtype=dtype, seed=4) * Dk**-0.5
    k = torch.nn.functional.normalize(random(T, H, Dk, seed=5), dim=-1).to(dtype)
    v = random(T, H, Dv, dtype=dtype, seed=6)
    g = (-torch.rand(g_shape, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    return q, k, v, g, beta, random(H, Dk, Dv, seed=7)


def _check_delta_rule(got, want, dtype) -> None:
    (out, after), (want_out, want_after) = got, want
    assert out.dtype == dtype and after.dtype == torch.float32
    assert_close(out, want_out, dtype)
    assert_close(after, want_after, torch.float32)  # the state is float32 whatever the inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("every_row", [False, True])
@pytest.mark.parametrize("decay", ["head", "key"])
@pytest.mark.parametrize("T,H,Dk,Dv", [(1, 3, 8, 12), (4, 2, 16, 20), (5, 2, 5, 7)])  # decode; 2 value blocks; odd
def test_recurrent_delta_rule_matches_the_reference(poisoned, dtype, every_row, decay, T, H, Dk, Dv):
    inputs = _delta_rule_inputs(T, H, Dk, Dv, dtype, per_key=decay == "key")
    got = delta_rule_triton.recurrent_gated_delta_rule(*inputs, every_row)
    want = delta_rule.recurrent_gated_delta_rule(*(t.double() for t in inputs), every_row)
    _check_delta_rule(got, want, dtype)
    assert got[1].shape == ((T, H, Dk, Dv) if every_row else (H, Dk, Dv))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decay", ["head", "key"])  # key: Kimi Delta Attention's prefill
def test_prefill_delta_rule_matches_the_chunked_reference(poisoned, dtype, decay):
    inputs = _delta_rule_inputs(70, 2, 8, 12, dtype, per_key=decay == "key")  # more than one 64-row chunk
    got = delta_rule_triton.chunked_gated_delta_rule(*inputs, chunk=64)
    want = delta_rule.chunked_gated_delta_rule(*(t.double() for t in inputs), chunk=64)
    _check_delta_rule(got, want, dtype)


def test_bad_shapes_and_chunks_are_refused_by_name():
    q, k, v, g, beta, state = _delta_rule_inputs(3, 2, 8, 12, torch.float32)
    with pytest.raises(InvalidArgumentError, match=r"g has shape \(3, 2, 12\), expected \(3, 2\)"):
        delta_rule_triton.recurrent_gated_delta_rule(q, k, v, v[..., 0:1].expand(3, 2, 12), beta, state)
    with pytest.raises(InvalidArgumentError, match=r"state has shape \(2, 12, 8\)"):
        delta_rule_triton.recurrent_gated_delta_rule(q, k, v, g, beta, state.transpose(1, 2))
    with pytest.raises(InvalidArgumentError, match="chunk must be at least 1"):
        delta_rule_triton.chunked_gated_delta_rule(q, k, v, g, beta, state, chunk=0)
    with pytest.raises(InvalidArgumentError, match=r"state \(K - 1, C\)"):
        delta_rule_triton.causal_conv1d(q[:, 0], torch.ones(8, 4), torch.zeros(2, 8))
