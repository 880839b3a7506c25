"""The streaming quantized GEMV (decode and verify steps) and the MoE decode kernels against the
torch reference, on every weight format, and the launches they cost: one per linear, two per MoE."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import triton.runtime.interpreter as interpreter
from kernel_cases import DEVICE, assert_close, random
from lucebox.kernels import moe, moe_triton, quant, quant_triton
from torch.utils._python_dispatch import TorchDispatchMode


def gguf_weight(shape: tuple[int, ...], bits: int, group: int, seed: int) -> quant.QuantizedTensor:
    """A GGUF K-quant style weight (..., N, K): float32 scales and mins, codes * scale - min."""
    g = torch.Generator().manual_seed(seed)
    *lead, K = shape
    if bits == 4:
        codes = torch.randint(0, 256, (*lead, K // 2), generator=g, dtype=torch.uint8)
    else:  # Q5_K's codes 0..31
        codes = torch.randint(0, 32, shape, generator=g).to(torch.int8)
    scales = torch.rand(*lead, K // group, generator=g) * 0.02 + 0.001
    mins = torch.rand(*lead, K // group, generator=g) * 0.1 * scales.mean()
    return quant.QuantizedTensor(codes.to(DEVICE), scales.to(DEVICE), None, bits, group, shape, torch.float32,
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


def make_weight(form: str | None, *shape: int, dtype: torch.dtype, seed: int = 0) -> quant.Weight:
    """A weight (..., N, K) in one of `FORMATS`, or plain (None), values of about 0.2."""
    if form is None:
        return random(*shape, dtype=dtype, seed=seed, scale=0.2)
    scheme, group, extra = FORMATS[form]
    if scheme == "gguf":
        w = gguf_weight(shape, extra, group, seed)
        w.dtype = dtype
        return w
    return quant.quantize(random(*shape, dtype=dtype, seed=seed, scale=0.2), scheme, group, extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", FORMATS)
# K 256: whole tiles (no masks); K 192 and 320: a partial last tile; N 21: a partial block of outputs.
@pytest.mark.parametrize("M,N,K,bias", [(1, 21, 256, True), (3, 16, 192, False), (16, 21, 320, True),
                                        (17, 21, 192, True)])
def test_gemv_matches_the_dequantized_reference(poisoned, dtype, form, M, N, K, bias):
    w = make_weight(form, N, K, dtype=dtype, seed=N)
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


def test_int4_rows_of_part_words_stream_dequantized_and_keep_a_rows_bits(poisoned):
    """The streaming kernels read int4 codes as 32-bit words of eight: rows of 36 inputs (4.5 words)
    and groups of 12 (1.5 words) are dequantized for the step and streamed as plain weights, exact,
    and a row alone gets the bits it gets in a 16-row verify block (the tile kernels' would not);
    groups of 24 (3 words) stream as they are stored."""
    x = random(16, 72, seed=1)
    for K, group, plain in ((36, None, True), (72, 12, True), (72, 24, False)):
        w = quant.quantize(random(21, K, seed=K), "int4", group)
        assert (quant_triton.streamed(w, K) is not w) == plain
        block = quant_triton.quantized_linear(x[:, :K], w)
        assert_close(block, x[:, :K].double() @ quant.dequantize(w).double().T, torch.float32)
        for r in (0, 11):
            assert torch.equal(quant_triton.quantized_linear(x[r : r + 1, :K], w), block[r : r + 1]), (K, group)
    E, F, H = 4, 36, 64  # experts of 36 intermediate features: their down matrices' rows are part words
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(16)]).to(DEVICE)
    weights = torch.rand(16, 3, generator=g).to(DEVICE)
    gate_up = quant.quantize(random(E, 2 * F, H, seed=2), "int4", 32)
    down = quant.quantize(random(E, H, F, seed=3), "int4", None)
    x = random(16, H, seed=4)
    block = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5)
    assert_close(block, moe.moe_experts(x.double(), _dense(gate_up), _dense(down), weights.double(), ids, 2.5),
                 torch.float32)
    for r in (0, 9):
        alone = moe_triton.moe_experts(x[r : r + 1], gate_up, down, weights[r : r + 1], ids[r : r + 1], 2.5)
        assert torch.equal(alone, block[r : r + 1])


def test_a_row_gets_the_same_bits_alone_and_in_a_verify_block(poisoned):
    """Greedy speculation keeps plain decoding's tokens only if a verified row's logits carry the bits a
    one-row step computes: the kernels sum each output in an order that does not depend on the rows."""
    x = random(16, 320, seed=5)
    for form in ("int4-g32", "int8"):
        w = make_weight(form, 21, 320, dtype=torch.float32)
        block = quant_triton.quantized_linear(x, w)
        for r in (0, 11):
            assert torch.equal(quant_triton.quantized_linear(x[r : r + 1], w), block[r : r + 1]), form
    # 16 rows over rows wider than one tile
    x, (gate_up, down), weights, ids, alone = _moe_case("int4-g32", 16, True, torch.float32, H=256)
    whole = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, *alone)
    for r in (0, 13):
        alone_row = moe_triton.moe_experts(x[r : r + 1], gate_up, down, weights[r : r + 1], ids[r : r + 1], 2.5, *alone)
        assert torch.equal(alone_row, whole[r : r + 1])


def test_a_step_with_no_rows_launches_nothing(poisoned):
    w = make_weight("int4-g32", 21, 64, dtype=torch.float32)
    with counted_launches() as (launches, _):
        y = quant_triton.quantized_linear(random(0, 64), w)
    assert y.shape == (0, 21) and launches == []
    x, (gate_up, down), weights, ids, alone = _moe_case("int4-g32", 1, True, torch.float32)
    assert moe_triton.moe_experts(x[:0], gate_up, down, weights[:0], ids[:0], 2.5, *alone).shape == (0, 64)


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
    w = make_weight(form, 24, 128, dtype=torch.float16)
    x, bias = random(1, 128, dtype=torch.float16), random(24, dtype=torch.float16, seed=1)
    with counted_launches() as (launches, mode):
        y = quant_triton.quantized_linear(x, w, bias)
    assert launches == ["_gemv_kernel"] and mode.ops == [], (launches, mode.ops)
    assert y.dtype == torch.float16


def _dense(w: quant.Weight) -> torch.Tensor:
    return quant.dequantize(w).double() if isinstance(w, quant.QuantizedTensor) else w.double()


def _moe_case(form, M, shared, dtype, E=4, F=64, H=64, K=3, F_shared=128):
    """Inputs of a Laguna-like layer, scaled down: 4 experts for 3 choices, so rows repeat experts."""
    g = torch.Generator().manual_seed(M)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(DEVICE)
    weights = torch.rand(M, K, generator=g).to(DEVICE)
    experts = (make_weight(form, E, 2 * F, H, dtype=dtype, seed=7), make_weight(form, E, H, F, dtype=dtype, seed=8))
    alone = (make_weight(form, 2 * F_shared, H, dtype=dtype, seed=9), make_weight(form, H, F_shared, dtype=dtype,
                                                                                   seed=10)) if shared else (None, None)
    return random(M, H, dtype=dtype, seed=M), experts, weights, ids, alone


# Every format at 1 and 3 rows; a full 16-row verify block (slow in the interpreter) for two of them.
MOE_CASES = [(dtype, form, M, shared) for dtype in (torch.float32, torch.float16)
             for form in (None, "int8", "int4-g32", "int4-asym-g64", "gguf-int4-g16")
             for M, shared in ((1, True), (3, False))] + [(torch.float32, "int4-g32", 16, True),
                                                          (torch.float16, "int8", 16, True)]


@pytest.mark.parametrize("dtype,form,M,shared", MOE_CASES)
def test_moe_decode_matches_the_reference(poisoned, dtype, form, M, shared):
    x, (gate_up, down), weights, ids, (s_gate_up, s_down) = _moe_case(form, M, shared, dtype)
    want = moe.moe_experts(x.double(), _dense(gate_up), _dense(down), weights.double(), ids, 2.5,
                           *((_dense(s_gate_up), _dense(s_down)) if shared else ()))
    got = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, s_gate_up, s_down)
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_moe_decode_rows_do_not_depend_on_the_other_rows(poisoned):
    """A row's choices are summed in choice order whatever its step's other rows chose: row groups
    run in the whole step's layout give the whole step's bits."""
    x, (gate_up, down), weights, ids, alone = _moe_case("int4-g32", 9, True, torch.float32)
    whole = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, *alone)
    for rows in (slice(0, 1), slice(1, 6), slice(6, 9)):
        part = moe_triton.moe_experts(x[rows], gate_up, down, weights[rows], ids[rows], 2.5, *alone, layout_of=(9, 4))
        assert torch.equal(part, whole[rows])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="counts the interpreter's launches")
@pytest.mark.parametrize("shared", [False, True])
def test_a_decode_moe_layer_is_two_launches(shared):
    x, (gate_up, down), weights, ids, alone = _moe_case("int4-g32", 1, shared, torch.float16)
    with counted_launches() as (launches, mode):
        y = moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, *alone)
    assert launches == ["_up_decode_kernel", "_down_decode_kernel"] and mode.ops == [], (launches, mode.ops)
    assert y.dtype == torch.float16


@contextmanager
def launch_arguments() -> Iterator[dict[str, tuple]]:
    """The positional arguments of each interpreted launch, by kernel name (the last launch's)."""
    seen: dict[str, tuple] = {}
    real_run = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        seen[self.fn.__name__] = args
        return real_run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        yield seen
    finally:
        interpreter.InterpretedFunction.run = real_run


def _among_others(x: torch.Tensor, r: int, seed: int) -> torch.Tensor:
    """16 rows: x's row r at row r, the other 15 new values."""
    block = random(16, *x.shape[1:], dtype=x.dtype, seed=seed)
    block[r] = x[r]
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_15_rows_beside_it(poisoned, dtype):
    """Every decode kernel pads its rows to the MMA's 16 and sums in one order: a row computed alone
    and among 15 other rows (a different set of them at each of its places) gets the same
    bits, from the GEMV and from each MoE kernel (the up kernel's `inter` rows and the layer's
    output), on every weight format. What greedy speculation and batched requests rest on."""
    x = random(16, 320, dtype=dtype, seed=5)
    for form in ("int4-g32", "int4-asym-g64", "gguf-int4-g16", "int8"):
        w = make_weight(form, 21, 320, dtype=dtype)
        for r in (0, 6, 15):  # another set of others at each place
            alone = quant_triton.quantized_linear(x[r : r + 1], w)
            assert torch.equal(quant_triton.quantized_linear(_among_others(x, r, 11 + r), w)[r : r + 1], alone)
    for form, r in (("int4-g32", 9), ("gguf-int4-g16", 0)):  # the row at another place in each
        x, (gate_up, down), weights, ids, shared = _moe_case(form, 16, True, dtype)
        K, P = ids.shape[1], ids.numel()
        with launch_arguments() as seen:
            alone = moe_triton.moe_experts(x[r : r + 1], gate_up, down, weights[r : r + 1], ids[r : r + 1], 2.5,
                                           *shared)
            alone_inter = seen["_up_decode_kernel"][1]
            others = _among_others(x, r, seed=13)
            among = moe_triton.moe_experts(others, gate_up, down, weights, ids, 2.5, *shared)
            inter = seen["_up_decode_kernel"][1]
        assert torch.equal(among[r : r + 1], alone), form
        F = down.shape[2]  # the routed rows' width (the shared expert's is wider: the rest is never written)
        routed, alone_routed = inter[r * K : (r + 1) * K, :F], alone_inter[:K, :F]
        assert torch.equal(routed, alone_routed) and torch.equal(inter[P + r], alone_inter[K]), form


@pytest.mark.parametrize("dtype", [torch.float16])  # the order is the slot table's, whatever the dtype
def test_moe_decode_bits_do_not_depend_on_how_experts_are_numbered(poisoned, dtype):
    """An expert cache renumbers experts by slot: the decode kernels sum a row's experts in choice
    order (not expert order), so the same experts under other numbers give the same bits, at one row
    and in a 16-row step where rows share experts at different choice positions."""
    for M in (1, 16):
        x, (gate_up, down), weights, ids, shared = _moe_case(None, M, True, dtype, E=6, K=4)
        new_number = torch.randperm(6, generator=torch.Generator().manual_seed(M)).to(DEVICE)
        old_of_new = torch.argsort(new_number)
        renumbered = moe_triton.moe_experts(x, gate_up[old_of_new], down[old_of_new], weights, new_number[ids], 2.5,
                                            *shared)
        assert torch.equal(renumbered, moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, *shared)), M
