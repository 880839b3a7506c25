"""Qwen3-Next (Gated DeltaNet + full attention) equals transformers, keeps its recurrent state
across prefill chunks and requests exactly, leaves its checkpoints' MTP head to the drafter, trains
through its recurrent layers (gradients), and refuses what it cannot do yet."""

import warnings

import pytest
import torch
from conftest import add_mtp_head, greedy_by_forwards, rewrite_weights
from lucebox.kernels.delta_rule import causal_conv1d, chunked_gated_delta_rule, recurrent_gated_delta_rule
from lucebox.models import build_model_config
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.errors import (
    CacheRewindError,
    ConfigError,
    LuceboxWarning,
    UnexpectedTensorError,
)
from lucebox.memory.plan import recurrent_state_bytes

PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def qwen3_next(reference_models):
    return reference_models("qwen3_next")


@pytest.fixture(scope="module")
def llm(qwen3_next):
    return lucebox.LLM(qwen3_next[0], device="cpu", dtype="float64", prefill_chunk=16)


def test_the_tiny_model_has_both_layer_kinds(llm):
    cfg = llm.config
    assert [layer.attention for layer in cfg.layers] == ["gdn", "full", "gdn", "full"]
    assert cfg.linear_attention.value_heads > cfg.linear_attention.key_heads  # grouped value heads
    assert {layer.mlp for layer in cfg.layers} == {"dense", "moe"} and cfg.moe.shared_expert_gate
    assert cfg.layers[1].rope.rotary_dim < cfg.head_dim and cfg.norm_offset == 1.0


def test_logits_match_transformers_across_prefill_chunks(llm, qwen3_next, exact_reference):
    _, ref = qwen3_next
    assert len(PROMPT) > 2 * llm.setup.prefill_chunk  # the state crosses two chunk boundaries
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    assert (llm.logits(PROMPT) - expected).abs().max().item() <= 1e-6


def test_60_greedy_tokens_match_transformers(llm, qwen3_next, exact_reference):
    """(On this model transformers' cached `generate` disagrees with its own forward from the first
    token, so the reference is a loop of forwards.)"""
    ids = greedy_by_forwards(qwen3_next[1], PROMPT[:12], 60)
    assert llm.generate(PROMPT[:12], max_tokens=60, ignore_eos=True).token_ids == ids[12:]


def test_the_model_s_load_passes_over_the_mtp_head_and_generation_is_unchanged(llm, model_copy):
    """Real checkpoints ship an MTP head (mtp.*): the drafter's (tests/test_mtp.py), which the
    model's own load leaves without a word."""
    folder = model_copy("qwen3_next")
    add_mtp_head(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LuceboxWarning)
        with_mtp = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=16, draft=None)
    assert (with_mtp.generate(PROMPT[:12], max_tokens=16, ignore_eos=True).token_ids
            == llm.generate(PROMPT[:12], max_tokens=16, ignore_eos=True).token_ids)


def test_an_unknown_tensor_beside_the_mtp_head_is_still_refused_by_name(llm, model_copy):
    folder = model_copy("qwen3_next")
    add_mtp_head(folder)
    rewrite_weights(folder, lambda t: t.update({"model.layers.0.linear_attn.mystery": torch.zeros(2)}))
    with pytest.raises(UnexpectedTensorError, match=r"1 tensor\(s\).*: model\.layers\.0\.linear_attn\.mystery\."):
        lucebox.LLM(folder, device="cpu", dtype="float64")


@pytest.mark.parametrize("decay_per", ["head", "key"])  # key: Kimi Delta Attention's rule
def test_chunked_delta_rule_equals_the_recurrent_one_from_any_state(decay_per):
    g = torch.Generator().manual_seed(0)
    T, H, Dk, Dv = 150, 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, v, state = rand(T, H, Dk), rand(T, H, Dv), rand(H, Dk, Dv)
    k = torch.nn.functional.normalize(rand(T, H, Dk), dim=-1)
    decay = -torch.rand(T, H, *(Dk,) * (decay_per == "key"), generator=g, dtype=torch.float64)  # log decay <= 0
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    out, final = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    _, every = recurrent_gated_delta_rule(q[:5], k[:5], v[:5], decay[:5], beta[:5], state, every_row=True)
    _, fifth = recurrent_gated_delta_rule(q[:5], k[:5], v[:5], decay[:5], beta[:5], state)
    assert every.shape == (5, H, Dk, Dv) and torch.equal(every[-1], fifth)
    # chunks of 64 with a partial last one, and a split in two calls carrying the state between them
    chunked, chunked_final = chunked_gated_delta_rule(q, k, v, decay, beta, state, chunk=64)
    first, middle = chunked_gated_delta_rule(q[:70], k[:70], v[:70], decay[:70], beta[:70], state, chunk=64)
    second, split_final = chunked_gated_delta_rule(q[70:], k[70:], v[70:], decay[70:], beta[70:], middle, chunk=64)
    for a, b in ((chunked, out), (chunked_final, final), (torch.cat([first, second]), out), (split_final, final)):
        assert (a - b).abs().max().item() < 1e-10


def test_causal_conv_carries_its_state_across_steps():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(6, 4, generator=g, dtype=torch.float64)
    whole, _ = causal_conv1d(x, weight, torch.zeros(3, 6, dtype=torch.float64))
    expected = torch.nn.functional.conv1d(x.T[None], weight[:, None], padding=3, groups=6)[0, :, :10].T
    assert (whole - torch.nn.functional.silu(expected)).abs().max() < 1e-12
    first, state = causal_conv1d(x[:4], weight, torch.zeros(3, 6, dtype=torch.float64))
    rest, _ = causal_conv1d(x[4:], weight, state)
    assert (torch.cat([first, rest]) - whole).abs().max() < 1e-12


def test_a_second_request_answers_as_a_fresh_engine(llm, qwen3_next):
    first = llm.generate(PROMPT[:20], max_tokens=6, ignore_eos=True)
    follow_up = PROMPT[:20] + first.token_ids + PROMPT[20:30]  # extends what the session holds: state reused
    diverging = PROMPT[:10] + PROMPT[30:40]  # shares a shorter prefix than the state's length: prefill from 0
    fresh = lucebox.LLM(qwen3_next[0], device="cpu", dtype="float64", prefill_chunk=16)
    for prompt in (follow_up, diverging):
        got = llm.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
        assert got == fresh.generate(prompt, max_tokens=8, ignore_eos=True).token_ids
        fresh.session.drop()
    assert llm.session.cache.memory()["recurrent_states"] == recurrent_state_bytes(llm.config, torch.float64) > 0


def test_a_recurrent_state_refuses_rollback_below_its_length(llm):
    cache = llm.engine.new_cache()
    llm.engine.decoder.forward(torch.tensor(PROMPT[:5]), Step.span(0, 5, llm.device, prefill=True), cache)
    cache.commit(5)
    assert cache.can_rewind_to(5) and cache.can_rewind_to(0) and not cache.can_rewind_to(3)
    with pytest.raises(CacheRewindError, match="recurrent"):
        cache.rollback(3)
    assert not cache.dirty  # refused before anything changed
    cache.rollback(0)
    start = cache.layers[0].step_state(torch.tensor([0]), prefill=False).current()
    assert cache.layers[0].rows == 0 and not any(state.any() for state in start)


@pytest.mark.parametrize("field, value", [("linear_num_value_heads", 0), ("linear_conv_kernel_dim", 1000),
                                          ("layer_types", ["linear_attention"] * 3 + ["mamba"]),
                                          ("decoder_sparse_step", 0)])
def test_bad_linear_attention_fields_name_themselves(qwen3_next, field, value):
    import json

    hf = json.loads((qwen3_next[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match=field if field != "layer_types" else "mamba"):
        build_model_config({**hf, field: value})


def test_the_training_forward_is_differentiable_through_recurrent_layers(llm, float64_kernels):
    """Gradients flow through a batch's Gated DeltaNet layers (conv, delta rule, gated norm): for
    weights of both recurrent layers, autograd's gradient of a loss equals central finite
    differences (float64 throughout)."""
    from lucebox.training.forward import forward_batch

    decoder = llm.engine.decoder
    ids = torch.tensor([PROMPT[:20], PROMPT[20:]])
    probe = torch.randn(2, 20, llm.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss() -> torch.Tensor:
        return (forward_batch(decoder, ids)[0] * probe).sum()

    for name, element in (("layers.0.gdn_A_log", 1), ("layers.0.gdn_qkvz", 100), ("layers.2.gdn_conv", 7)):
        weight = decoder.w[name]
        weight.requires_grad_(True)
        (grad,) = torch.autograd.grad(loss(), weight)
        weight.requires_grad_(False)
        flat, eps = weight.view(-1), 1e-6
        kept = flat[element].item()
        with torch.no_grad():
            flat[element] = kept + eps
            up = loss().item()
            flat[element] = kept - eps
            down = loss().item()
            flat[element] = kept
        assert grad.view(-1)[element].item() == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-7), name
