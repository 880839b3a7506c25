"""MoE routing: the router GEMM in float32 (torch reference and Triton), and the routers kept in
float32 at load."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DEVICE, no_host_sync, random
from lucebox.kernels import moe, route_triton

import lucebox
import lucebox.memory.plan
from lucebox.config import MoESpec


def spec(router="sigmoid", top_k=5, experts=37, normalize=True, softcap=0.0, bias=False, float32_weights=False):
    return MoESpec(num_experts=experts, top_k=top_k, expert_size=8, router=router, normalize_topk=normalize,
                   logit_softcap=softcap, correction_bias=bias, float32_weights=float32_weights)


def assert_same_routing(got, want):
    assert torch.equal(got[1], want[1])  # the same experts, in the same order
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_triton_routing_matches_the_reference(rows, router, softcap, with_bias, normalize):
    """37 experts (not a power of two), scaled like real router logits: the same ids, weights to float32 rounding."""
    s = spec(router, normalize=normalize, softcap=softcap, bias=with_bias)
    h, w = random(rows, 40, seed=rows), random(37, 40, scale=0.2, seed=2)
    bias = random(37, scale=0.05, seed=3) if with_bias else None
    assert_same_routing(route_triton.moe_route(h, w, s, bias), moe.moe_route(h, w, s, bias))


def test_a_nan_row_routes_to_real_experts_with_a_nan_weight():
    """The MoE kernels index expert weights with the ids: a NaN row must not yield an id past the last
    expert, and must stay non-finite (the engine then raises its typed error)."""
    h, w = random(3, 40, seed=4), random(37, 40, scale=0.2, seed=2)
    h[1, 5] = float("nan")
    weights, ids = route_triton.moe_route(h, w, spec())
    assert bool(((ids >= 0) & (ids < 37)).all()), ids
    assert not torch.isfinite(weights[1]).all() and torch.isfinite(weights[[0, 2]]).all()
    assert_same_routing((weights[[0, 2]], ids[[0, 2]]), tuple(t[[0, 2]] for t in moe.moe_route(h, w, spec())))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_routing_reads_half_inputs_and_gives_the_model_or_float32_weights(dtype):
    """Half-precision rows and router are read as float32; weights come out in the model dtype, or float32."""
    h, w = random(4, 64, dtype=dtype, seed=5), random(300, 64, dtype=dtype, scale=0.2, seed=6)
    for float32_weights in (False, True):
        s = spec("softmax", top_k=8, experts=300, float32_weights=float32_weights)
        got = route_triton.moe_route(h, w, s)
        assert got[0].dtype == (torch.float32 if float32_weights else dtype)
        assert_same_routing(got, moe.moe_route(h, w, s))


def test_prefill_rows_take_the_reference():
    s = spec()
    h, w = random(17, 40, seed=7), random(37, 40, scale=0.2, seed=8)
    assert_same_routing(route_triton.moe_route(h, w, s), moe.moe_route(h, w, s))


def test_routing_stays_on_the_device():
    s = spec(softcap=2.0, bias=True)
    h, w, bias = random(5, 40), random(37, 40, scale=0.2, seed=1), random(37, scale=0.05, seed=2)
    with no_host_sync():
        for op in (moe.moe_route, route_triton.moe_route):
            weights, ids = op(h, w, s, bias)
    assert weights.shape == ids.shape == (5, 5)


def close_experts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h (1, 2), router (4, 2), bias (4,)), all exact in bfloat16: expert 1's logit (1 + 0.003) beats
    expert 0's (1.0) by more than expert 0's bias (1e-4) gives back, but bfloat16 (steps of 2^-7
    near 1) rounds both logits to 1.0, and then the bias hands the choice to expert 0."""
    h = torch.tensor([[1.0, 1.0]], device=DEVICE)
    router = torch.tensor([[1.0, 0.0], [1.0, 0.003], [-5.0, 0.0], [-5.0, 0.0]], device=DEVICE).bfloat16().float()
    bias = torch.tensor([1e-4, 0.0, 0.0, 0.0], device=DEVICE).bfloat16().float()
    return h, router, bias


def test_a_bfloat16_router_gemm_flips_an_expert_the_float32_router_keeps():
    h, router, bias = close_experts()
    s = spec("sigmoid", top_k=1, experts=4, bias=True)
    want = moe.route(F.linear(h.double(), router.double()), s, bias)[1]  # the exact logits' choice
    assert want.item() == 1
    bf16 = h.bfloat16(), router.bfloat16()
    assert moe.route(F.linear(*bf16), s, bias)[1].item() == 0  # the old bfloat16 GEMM chooses wrongly
    assert moe.moe_route(bf16[0], router, s, bias)[1].item() == 1  # the router as loaded: float32
    assert moe.moe_route(*bf16, s, bias)[1].item() == 1  # even a bfloat16 router, upcast for the GEMM
    assert route_triton.moe_route(h.half(), router, s, bias)[1].item() == 1


@pytest.mark.skipif(DEVICE.type != "cpu", reason="loads a bfloat16 model on the CPU")
def test_routers_are_kept_in_float32_at_load_and_counted_so(tmp_path, reference_models):
    """A bfloat16 model holds its routers (and correction biases) in float32, experts in bfloat16,
    and the memory plan counts the bytes it holds."""
    folder, _ = reference_models("laguna")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    llm = lucebox.LLM(tmp_path, device="cpu", dtype="bfloat16", backend="torch", load_format="dummy")
    routers = [name for name in llm.engine.decoder.w if name.endswith((".router", ".router_bias"))]
    assert routers and all(llm.engine.decoder.w[name].dtype == torch.float32 for name in routers)
    assert all(w.dtype == torch.bfloat16 for name, w in llm.engine.decoder.w.items() if name not in routers)
    assert llm.memory()["weights"] == lucebox.memory.plan.weight_bytes(llm.config, torch.bfloat16)


def test_a_float32_router_keeps_its_bits_in_a_bfloat16_model(reference_models):
    """A router stored in float32 is read in float32, not rounded through the model's bfloat16 first."""
    folder, _ = reference_models("laguna")
    wide = lucebox.LLM(folder, device="cpu", dtype="float32", backend="torch")
    narrow = lucebox.LLM(folder, device="cpu", dtype="bfloat16", backend="torch")
    routers = [name for name in wide.engine.decoder.w if name.endswith(".router")]
    assert routers and all(torch.equal(narrow.engine.decoder.w[name], wide.engine.decoder.w[name]) for name in routers)


def test_a_gguf_router_is_read_in_float32_whatever_the_model_dtype(tmp_path):
    """llama.cpp stores routers in F32: a float16 model reads them unrounded, and plans their bytes so."""
    from gguf_models import write_tiny_gguf

    from lucebox.speculative.proposer import tensor_bytes

    write_tiny_gguf("qwen3moe", "Q4_K", tmp_path / "model.gguf")
    half = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float16")
    full = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32")
    assert half.engine.decoder.w["embed"].dtype == torch.float16
    assert torch.equal(half.engine.decoder.w["layers.1.router"], full.engine.decoder.w["layers.1.router"])
    held = tensor_bytes(half.engine.decoder.w.values())  # views of a fused projection share its bytes
    assert half.setup.memory["weights"] == held
