"""The one dispatch point between the Triton kernels and their torch references.

`resolve_backend` turns the user's `backend=` into "torch" or "triton" ("auto": Triton on CUDA
when it is installed, the references elsewhere); `kernels_for` returns the table of operators a
model runs with. Triton modules are imported only here and only when chosen: `triton.jit` picks
compiled or interpreted kernels when a module is imported, so on the CPU TRITON_INTERPRET=1 must
be set before that.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from lucebox.errors import BackendError, InvalidArgumentError
from lucebox.limits import BACKENDS

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend '{backend}' is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        usable = device.type == "cuda" and triton_installed() and dtype in _TRITON_DTYPES
        return "triton" if usable and not _bf16_unsupported(device, dtype) else "torch"
    if backend == "torch":
        return "torch"
    if not triton_installed():
        raise BackendError("backend='triton' needs the triton package (pip install triton), or use backend='torch'")
    if dtype not in _TRITON_DTYPES:
        raise BackendError(f"the Triton kernels take float32, float16 or bfloat16, not {dtype}; "
                           "use backend='torch' for this dtype")
    if _bf16_unsupported(device, dtype):
        raise BackendError("this GPU predates bfloat16 matrix units (compute capability 8.0), which the Triton "
                           "kernels need for bfloat16; use dtype='float16' or backend='torch'")
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendError("backend='triton' on the CPU runs Triton's interpreter: start Python with "
                               "TRITON_INTERPRET=1, or use backend='torch'")
        if dtype == torch.bfloat16:
            raise BackendError("Triton's CPU interpreter computes bfloat16 wrongly; use dtype float32 or float16 "
                               "with backend='triton' on the CPU")
    return "triton"


def _bf16_unsupported(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0)


@dataclass(frozen=True)
class Kernels:
    """The hot-path operators of one backend; each has the signature of its torch reference."""

    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    rotate: Callable
    softplus_gate: Callable
    attention_partial: Callable
    moe_experts: Callable
    moe_route: Callable  # router GEMM in float32 + expert choice: (weights, ids)
    linear: Callable  # x @ w.T (+ bias) for plain or quantized weights
    greedy_choices: Callable  # each row's argmax after the LM head, -1 in a row that is not finite
    causal_conv1d: Callable  # the Gated DeltaNet mixer's conv + silu, and its state
    recurrent_gated_delta_rule: Callable  # decode / verify rows (each row's state with every_row)
    chunked_gated_delta_rule: Callable  # prefill rows
    norm_rope_store: Callable  # a graphed step's q/k norm, RoPE and K/V store in one (`kernels.rope_store`)


@cache
def kernels_for(backend: str) -> Kernels:
    """Operators for a resolved backend ("torch" or "triton")."""
    from lucebox.kernels import attention, delta_rule, gate, moe, norm, quant, rope, rope_store

    from lucebox.sampling import greedy_choices

    if backend == "torch":
        return Kernels("torch", norm.rms_norm, norm.add_rms_norm, rope.rotate, gate.softplus_gate,
                       attention.attention_partial, moe.moe_experts, moe.moe_route, quant.linear,
                       greedy_choices, delta_rule.causal_conv1d, delta_rule.recurrent_gated_delta_rule,
                       delta_rule.chunked_gated_delta_rule, rope_store.norm_rope_store)
    if backend != "triton":
        raise InvalidArgumentError(f"kernels_for takes 'torch' or 'triton', got '{backend}'")
    from lucebox.kernels import (
        attention_triton,
        delta_rule_triton,
        gate_triton,
        greedy_triton,
        moe_triton,
        norm_triton,
        quant_triton,
        rope_store_triton,
        rope_triton,
        route_triton,
    )

    return Kernels("triton", norm_triton.rms_norm, norm_triton.add_rms_norm, rope_triton.rotate,
                   gate_triton.softplus_gate, attention_triton.attention_partial, moe_triton.moe_experts,
                   route_triton.moe_route, quant_triton.linear, greedy_triton.greedy_choices,
                   delta_rule_triton.causal_conv1d, delta_rule_triton.recurrent_gated_delta_rule,
                   delta_rule_triton.chunked_gated_delta_rule, rope_store_triton.norm_rope_store)
