"""The streaming quantized GEMV (decode and verify steps) and the MoE decode kernels against the
torch reference, on every weight format, and the launches they cost: one per linear, two per MoE."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import triton.runtime.interpreter as interpreter
from kernel_cases import DEVICE, assert_close, random
from lucebox.kernels import quant, quant_triton
from torch.utils._python_dispatch import TorchDispatchMode


def gguf_weight(N: int, K: int, bits: int, group: int, seed: int) -> quant.QuantizedTensor:
    """A GGUF K-quant style weight: float32 scales and mins, codes * scale - min."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    else:  # Q5_K's codes 0..31
        codes = torch.randint(0, 32, (N, K), generator=g).to(torch.int8)
    scales = torch.rand(N, K // group, generator=g) * 0.02 + 0.001
    mins = torch.rand(N, K // group, generator=g) * 0.1
    return quant.QuantizedTensor(codes.to(DEVICE), scales.to(DEVICE), None, bits, group, (N, K), torch.float32,
                                 mins.to(DEVICE))


# (scheme, group, asymmetric) for `quant.quantize`, or ("gguf", group, bits).
FORMATS = {
    "int8": ("int8", None, False),
    "int4-g32": ("int4", 32, False),
    "int4-asym-g64": ("int4", 64, True),
    "gguf-int4-g16": ("gguf", 16, 4),
    "gguf-int4-g32": ("gguf", 32, 4),
    "gguf-int8-g16": ("gguf", 16, 8),
}


def make_weight(form: str, N: int, K: int, dtype: torch.dtype, seed: int = 0) -> quant.QuantizedTensor:
    scheme, group, extra = FORMATS[form]
    if scheme == "gguf":
        w = gguf_weight(N, K, extra, group, seed)
        w.dtype = dtype
        return w
    return quant.quantize(random(N, K, dtype=dtype, seed=seed), scheme, group, extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", FORMATS)
# K 256: whole tiles (no masks); K 192 and 320: a partial last tile; N 21: a partial block of outputs.
@pytest.mark.parametrize("M,N,K,bias", [(1, 21, 256, True), (3, 16, 192, False), (16, 21, 320, True),
                                        (17, 21, 192, True)])
def test_gemv_matches_the_dequantized_reference(poisoned, dtype, form, M, N, K, bias):
    w = make_weight(form, N, K, dtype, seed=N)
    x = random(M, K, dtype=dtype, seed=M)
    b = random(N, dtype=dtype, seed=3) if bias else None
    want = torch.nn.functional.linear(x.double(), quant.dequantize(w).double(), b.double() if bias else None)
    got = quant_triton.quantized_linear(x, w, b)
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_gemv_handles_groups_that_do_not_divide_its_tiles(poisoned):
    """An int4 row of 40 inputs in one group, and groups of 40 (not a power of two)."""
    for K, group in ((40, None), (120, 40)):
        w = quant.quantize(random(5, K, seed=K), "int4", group)
        x = random(2, K, seed=1)
        assert_close(quant_triton.quantized_linear(x, w), x.double() @ quant.dequantize(w).double().T, torch.float32)


IGNORED_OPS = {"empty", "empty_strided", "view", "_unsafe_view", "reshape", "expand", "t", "transpose",
               "as_strided", "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "permute"}


class ComputeOps(TorchDispatchMode):
    """Records the ATen ops run outside Triton launches, views and empty allocations aside."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_launch and name not in IGNORED_OPS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_launches() -> Iterator[tuple[list[str], ComputeOps]]:
    """(the names of the Triton kernels launched, the ATen compute ops run between launches)."""
    launches: list[str] = []
    real_run = interpreter.InterpretedFunction.run
    mode = ComputeOps()

    def run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        mode.in_launch = True  # the interpreter's own copies are not the wrapper's ops
        try:
            return real_run(self, *args, **kwargs)
        finally:
            mode.in_launch = False

    interpreter.InterpretedFunction.run = run
    try:
        with mode:
            yield launches, mode
    finally:
        interpreter.InterpretedFunction.run = real_run


@pytest.mark.skipif(DEVICE.type == "cuda", reason="counts the interpreter's launches")
@pytest.mark.parametrize("form", ["int8", "int4-asym-g64", "gguf-int4-g16"])
def test_a_decode_linear_is_one_launch_with_bias_and_cast_inside(form):
    w = make_weight(form, 24, 128, torch.float16)
    x, bias = random(1, 128, dtype=torch.float16), random(24, dtype=torch.float16, seed=1)
    with counted_launches() as (launches, mode):
        y = quant_triton.quantized_linear(x, w, bias)
    assert launches == ["_gemv_kernel"] and mode.ops == [], (launches, mode.ops)
    assert y.dtype == torch.float16
