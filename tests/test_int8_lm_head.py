"""The int8 LM head (`lm_head=`, `lucebox.memory.lm_head`): chosen by the planner for quantized
weights, counted in the plan, close to the float head in distribution, and part of the target that
speculation verifies against."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import EXAMPLES
from lucebox.kernels.quant import QuantizedTensor, dequantize

import lucebox
from lucebox.checkpoints.loading import describe_model
from lucebox.cli.__main__ import main as cli_main
from lucebox.engine.config import EngineConfig
from lucebox.errors import InvalidArgumentError
from lucebox.memory.lm_head import choose_lm_head, float_head_bytes, int8_head_bytes
from lucebox.memory.vram import plan_for_budget
from lucebox.training.corpus import read_texts, stdlib_files

# Mean KL(float head || int8 head) per token, in nats, on held-out text: 4.2e-5 on these 512 tokens
# (4.0e-5 on 2048: bench/results/int8_head_kl-cpu.json), the order of the int8 KV pool's error the
# project already ships (5e-5 in decode, bench/results/kv_int8_error-cpu.json), and a change of the
# text's log-likelihood under 0.001 nats. The limit leaves 5x for other machines' rounding; an int4
# head (groups of 32) gives 9.3e-3 here, and fails it.
MEAN_KL_LIMIT = 2e-4
TOKENS = 512


@pytest.fixture(scope="module")
def heads():
    options = dict(device="cpu", dtype="float32", draft=None, max_context=1024)
    return lucebox.LLM(lm_head="float", **options), lucebox.LLM(lm_head="int8", **options)


@pytest.fixture(scope="module")
def held_out(heads):
    return heads[0].tokenizer.encode("\n".join(read_texts(stdlib_files("held_out")[:4])))[:TOKENS]


def _mean_kl(float_logits: torch.Tensor, int8_logits: torch.Tensor) -> float:
    log_p, log_q = torch.log_softmax(float_logits.double(), -1), torch.log_softmax(int8_logits.double(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def test_int8_head_mean_kl_per_token_stays_below_the_limit_on_held_out_text(heads, held_out):
    float_head, int8_head = heads
    assert len(held_out) == TOKENS
    want, got = float_head.logits(held_out), int8_head.logits(held_out)
    assert 0 < _mean_kl(want, got) < MEAN_KL_LIMIT
    assert (want.argmax(-1) == got.argmax(-1)).double().mean() > 0.98  # 0.992: 4 of 512 near-ties flip


def test_tied_embedding_lookup_keeps_reading_the_float_table(heads, held_out):
    """Only the head matmul reads codes: the table, every hidden state and the float head's logits
    of those states are the float model's, bit for bit."""
    float_head, int8_head = heads
    w_float, w_int8 = float_head.engine.decoder.w, int8_head.engine.decoder.w
    assert float_head.config.tie_word_embeddings and "lm_head" not in w_float
    assert isinstance(w_int8["lm_head"], QuantizedTensor) and w_int8["lm_head"].bits == 8
    assert w_int8["lm_head"].scales.shape == (float_head.config.vocab_size, 1)  # one scale per row
    assert torch.equal(w_int8["embed"], w_float["embed"])
    ids = torch.tensor(held_out[:64])
    for a, b in zip(float_head.engine.decoder.embed(ids), int8_head.engine.decoder.embed(ids), strict=True):
        assert torch.equal(a, b)
    hidden = [torch.cat(list(llm.engine.prefill(held_out[:64], llm.engine.new_cache()))) for llm in heads]
    assert torch.equal(hidden[0], hidden[1])
    codes_logits = int8_head.engine.decoder.logits(hidden[1])  # the head alone differs: it reads the codes
    assert torch.allclose(codes_logits, hidden[1] @ dequantize(w_int8["lm_head"]).T, rtol=1e-5, atol=1e-5)
    assert not torch.equal(codes_logits, float_head.engine.decoder.logits(hidden[0]))


def test_greedy_speculation_with_the_int8_head_equals_plain_decoding(held_out):
    """The head is part of the target: drafts (the built-in DFlash drafter reads the target's head
    too) are verified against the int8 head's argmax, so the output is plain decoding's with it."""
    options = dict(device="cpu", dtype="float32", max_context=1024, lm_head="int8")
    prompt = held_out[:48]
    plain = lucebox.LLM(draft=None, **options).generate(prompt, max_tokens=48, ignore_eos=True).token_ids
    fast = lucebox.LLM(draft="auto", adaptive=False, **options).generate(prompt, max_tokens=48, ignore_eos=True)
    assert fast.token_ids == plain
    assert fast.stats["rounds"] < 48  # drafts were accepted: speculation really ran


def test_planner_picks_the_int8_head_for_quantized_weights_where_kernels_read_codes():
    cfg = describe_model(None).cfg  # the built-in model's
    bf16 = torch.bfloat16
    assert choose_lm_head("auto", "int4", "triton", cfg, bf16) == "int8"
    assert choose_lm_head("auto", "int8", "triton", cfg, bf16) == "int8"
    assert choose_lm_head("auto", None, "triton", cfg, bf16) is None  # float weights keep the float head
    assert choose_lm_head("auto", "int4", "torch", cfg, bf16) is None  # the CPU reads a dense copy: no saving
    assert choose_lm_head("auto", "int4", "triton", cfg, bf16, gguf=True) is None  # a file's head as it is
    assert choose_lm_head("float", "int4", "triton", cfg, bf16) is None
    assert choose_lm_head("int8", None, "torch", cfg, bf16) == "int8"
    assert int8_head_bytes(cfg) < float_head_bytes(cfg, bf16) / 1.9
    with pytest.raises(InvalidArgumentError, match="lm_head 'int4' is not one of auto, float, int8"):
        EngineConfig(lm_head="int4")
    with pytest.raises(InvalidArgumentError, match="lm_head 'int4' is not one of"):
        choose_lm_head("int4", "int4", "triton", cfg, bf16)
    with pytest.raises(InvalidArgumentError, match="GGUF"):
        choose_lm_head("int8", None, "triton", cfg, bf16, gguf=True)
    # On the GPU the torch backend would rebuild the float head every step from the codes.
    with pytest.raises(InvalidArgumentError, match="backend='triton' or lm_head 'float'"):
        choose_lm_head("int8", "int4", "torch", cfg, bf16, on_gpu=True)
    assert choose_lm_head("int8", "int4", "triton", cfg, bf16, on_gpu=True) == "int8"


@pytest.mark.parametrize("tied", [True, False])
def test_memory_plan_counts_the_int8_head_as_loaded(tmp_path, tied):
    """Untied, the codes replace the float head; tied, they are held beside the float table."""
    shutil.copytree(EXAMPLES / "laguna-tiny", tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tied}))
    options = dict(device="cpu", dtype="float32", backend="torch", load_format="dummy", quantization="int8",
                   max_context=1024, draft=None)
    plain, int8 = (lucebox.LLM(tmp_path / "model", lm_head=head, **options) for head in ("float", "int8"))
    assert int8.setup.lm_head == "int8" and plain.setup.lm_head is None
    cfg = plain.config
    planned = int8.setup.memory["weights"] - plain.setup.memory["weights"]  # the plan, before any weight loads
    assert planned == int8.memory()["weights"] - plain.memory()["weights"]  # the weights as loaded
    float_head = float_head_bytes(cfg, torch.float32)
    assert planned == (int8_head_bytes(cfg) if tied else int8_head_bytes(cfg) - float_head)
    dense = int8.setup.memory["dense_copies_cpu_max"] - plain.setup.memory["dense_copies_cpu_max"]
    assert dense == float_head  # the CPU's dense copy of the codes
    int8.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
    assert int8.memory()["dense_copies_cpu"] - plain.memory()["dense_copies_cpu"] >= float_head


def test_info_shows_the_head_the_plan_holds(capsys):
    assert cli_main(["info", "--vram", "24GiB", "--quantization", "int4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["vram_plan"]
    assert plan["choices"]["lm_head"] == "int8"
    assert cli_main(["info", "--vram", "24GiB", "--quantization", "int4", "--lm-head", "float", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["vram_plan"]
    assert kept["choices"]["lm_head"] == "float"
    assert kept["choices"]["lm_head_bytes_per_token"] > 1.9 * plan["choices"]["lm_head_bytes_per_token"]
    assert cli_main(["info", "--vram", "24GiB", "--quantization", "int4"]) == 0
    assert "lm_head int8" in capsys.readouterr().out


def test_the_xs2_plan_at_24_gib_holds_and_reads_fewer_head_bytes_with_int8():
    """Laguna XS.2 (untied), int4, 256K, select: the int8 head's saving shows in the plan's weights."""
    xs2 = describe_model(EXAMPLES / "laguna-xs2").cfg
    plans = {head: plan_for_budget(xs2, 24 * 2**30, 262144, torch.bfloat16, "int4", lm_head=head)
             for head in (None, "int8")}
    assert all(plan.fits for plan in plans.values()) and not xs2.tie_word_embeddings
    saved = float_head_bytes(xs2, torch.bfloat16) - int8_head_bytes(xs2)
    assert plans[None].device["weights"] - plans["int8"].device["weights"] == saved
    assert plans["int8"].choices["lm_head_bytes_per_token"] == int8_head_bytes(xs2)
    assert any("lm_head int8" in line for line in plans["int8"].lines())
