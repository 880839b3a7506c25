"""llama.cpp GGUF models: lucebox's logits equal those of the same model with the weights the
`gguf` package itself dequantizes, for every supported block type and architecture; weights stay
quantized; unsupported files are refused in one line naming the key or tensor."""

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf_models import (
    QUANT_TYPES,
    QUANTIZABLE,
    VOCAB,
    random_blocks,
    reference_logits,
    relative_error,
    write_tiny_gguf,
)
from lucebox.kernels import moe, quant
from lucebox.kernels.quant import QuantizedTensor

import lucebox
from lucebox.checkpoints.gguf import model as gguf_loading
from lucebox.checkpoints.gguf.blocks import BLOCK_SHAPES, repacked_bytes, unpack
from lucebox.cli import main
from lucebox.errors import ConfigError, ModelNotFoundError, TensorDtypeError, UnsupportedArchitectureError

PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(1)).tolist()


def _layout(block_type: str) -> tuple:
    """What the kernels' code paths depend on in a repacked block type: bits, group, low values or not
    (scales are loaded as float32 whichever their dtype)."""
    block_bytes, block_size = BLOCK_SHAPES[block_type]
    q = unpack(torch.zeros(1, block_bytes, dtype=torch.uint8), block_type, (1, block_size), torch.float32)
    return q.bits, q.group, q.mins is None


# One block type per layout (the first by name: float16 and float32 scales are both among them).
KERNEL_LAYOUTS = sorted({_layout(t): t for t in sorted(BLOCK_SHAPES, reverse=True)}.values())


@pytest.mark.parametrize("block_type", sorted(BLOCK_SHAPES))
def test_every_block_type_decodes_exactly_to_what_gguf_dequantizes(block_type):
    """Random bytes (every code and sub-scale bit pattern, sane float16 scales), and where gguf-py
    can quantize to the type, its own blocks too."""
    rng = np.random.default_rng(0)
    raw = random_blocks(block_type, (3, 5), 512, rng)
    if block_type in QUANTIZABLE:
        floats = rng.normal(0, 0.02, (2, 5, 512)).astype(np.float32)
        raw = np.concatenate((raw, gguf.quants.quantize(floats, gguf.GGMLQuantizationType[block_type])))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[block_type])
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    shape = (raw.shape[0], 5, 512)
    q = unpack(torch.from_numpy(raw), block_type, shape, torch.float64)
    assert torch.equal(quant.dequantize(q), torch.from_numpy(want).double())  # exact, not just within 1e-6
    assert q.nbytes() == repacked_bytes(block_type) * want.size < want.size * 2  # below a 16-bit weight


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_logits_equal_the_gguf_dequantized_model(qtype, tmp_path):
    """Qwen3-MoE (a dense layer, then routed experts) with every linear weight, the embedding and
    the output head in one GGUF type."""
    ref = write_tiny_gguf("qwen3moe", qtype, tmp_path / "model.gguf")
    want = reference_logits(ref, PROMPT)
    assert relative_error(lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64).logits(PROMPT),
                          want) <= 1e-6
    assert relative_error(lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32").logits(PROMPT),
                          want) <= 1e-4


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_K"), ("llama3", "Q8_0"), ("mixtral", "Q8_0"), ("qwen3", "Q6_K"),
                                        ("laguna", "Q5_K")])
def test_every_architecture_matches_transformers(arch, qtype, tmp_path):
    """llama's q/k rows come un-interleaved (its attention has biases, which move too); Llama 3.1's
    RoPE scaling comes as a rope_freqs tensor of frequency divisors; Mixtral is
    architecture llama with experts; qwen3 ties its embeddings; laguna: per-layer heads, sliding
    layers by pattern, YaRN partial rotary, per-element gate, soft-capped sigmoid router with a
    correction bias, shared expert, routed scaling."""
    ref = write_tiny_gguf(arch, qtype, tmp_path / "model.gguf")
    want = reference_logits(ref, PROMPT)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert relative_error(llm.logits(PROMPT), want) <= 1e-6
    assert relative_error(lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32").logits(PROMPT),
                          want) <= 1e-4
    assert llm.description.generation_config == {}


def test_laguna_model_exercises_every_feature(tmp_path):
    write_tiny_gguf("laguna", "Q8_0", tmp_path / "model.gguf")
    cfg = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32").config
    assert [layer.attention for layer in cfg.layers] == ["full", "sliding", "sliding", "sliding"]
    assert [layer.num_heads for layer in cfg.layers] == [4, 8, 8, 8]
    assert cfg.layers[0].rope.kind == "yarn" and cfg.layers[0].rope.rotary_dim == 32
    assert cfg.layers[1].rope.kind == "default" and cfg.layers[1].rope.rotary_dim == 64
    assert cfg.attention_gate == "element" and [layer.mlp for layer in cfg.layers] == ["dense"] + ["moe"] * 3
    assert (cfg.moe.routed_scaling, cfg.moe.logit_softcap, cfg.moe.shared_expert_size) == (2.5, 2.0, 256)


def test_linear_weights_stay_quantized_and_the_rest_is_in_the_model_dtype(tmp_path):
    write_tiny_gguf("qwen3moe", "Q4_K", tmp_path / "model.gguf")
    w = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32").engine.decoder.w
    for name in ("layers.0.wq", "layers.0.w_gate_up", "layers.1.experts_gate_up", "layers.1.experts_down"):
        assert isinstance(w[name], QuantizedTensor) and w[name].bits == 4 and w[name].mins is not None, name
    for name in ("embed", "lm_head", "layers.1.router", "norm"):
        assert isinstance(w[name], torch.Tensor) and w[name].dtype == torch.float32, name


# Every block type but two in one Qwen3-MoE file (16 weights; Q4_0 and Q5_K have whole files in
# QUANT_TYPES above).
EVERY_TYPE = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K", "blk.0.attn_q.weight": "Q5_0",
              "blk.0.attn_k.weight": "Q5_1", "blk.0.attn_v.weight": "IQ2_XXS", "blk.0.attn_output.weight": "IQ3_XXS",
              "blk.0.ffn_gate.weight": "Q4_1", "blk.0.ffn_up.weight": "Q3_K", "blk.0.ffn_down.weight": "Q2_K",
              "blk.1.attn_q.weight": "IQ4_XS", "blk.1.attn_k.weight": "IQ2_XS", "blk.1.attn_v.weight": "IQ2_S",
              "blk.1.attn_output.weight": "IQ3_S", "blk.1.ffn_gate_exps.weight": "MXFP4",
              "blk.1.ffn_up_exps.weight": "IQ4_NL", "blk.1.ffn_down_exps.weight": "Q4_K"}


def test_a_file_mixing_every_block_type_matches_its_dequantized_twin(tmp_path, monkeypatch):
    """llama.cpp's mixes can give the fused halves different types: gate and up of the dense layer
    (Q4_1 with a low value, Q3_K with the implicit zero 8) and of the experts (MXFP4's float32
    scales, IQ4_NL's float16 ones) are widened to one layout without changing a value."""
    assert set(BLOCK_SHAPES) - set(EVERY_TYPE.values()) == {"Q4_0", "Q5_K"}
    ref = write_tiny_gguf("qwen3moe", "Q4_K", tmp_path / "model.gguf", types=EVERY_TYPE)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert relative_error(llm.logits(PROMPT), reference_logits(ref, PROMPT)) <= 1e-6
    # On the CPU q, k, v of mixed types fuse as one dense weight of their kept dense copies
    # (`models/fused_projections.py`); with no host room for those, IQ4_XS stays in codes.
    assert type(llm.engine.decoder.w["layers.1.wqkv"]) is torch.Tensor
    monkeypatch.setattr(quant, "_free_host_bytes", lambda: 0)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert isinstance(llm.engine.decoder.w["layers.1.wq"], QuantizedTensor)


@pytest.mark.parametrize("block_type", KERNEL_LAYOUTS)
def test_triton_kernels_read_every_gguf_layout(block_type):
    from lucebox.kernels import moe_triton, quant_triton

    rng = np.random.default_rng(0)
    w = unpack(torch.from_numpy(random_blocks(block_type, (8,), 512, rng)), block_type, (8, 512), torch.float32)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.linear(x.double(), quant.dequantize(w).double())
    assert relative_error(quant_triton.quantized_linear(x, w), want) <= 1e-5
    x = x[:, :256]
    E, F, H = 3, 256, 256
    gate_up = unpack(torch.from_numpy(random_blocks(block_type, (E, 2 * F), H, rng)), block_type, (E, 2 * F, H),
                     torch.float32)
    down = unpack(torch.from_numpy(random_blocks(block_type, (E, H), F, rng)), block_type, (E, H, F), torch.float32)
    ids = torch.tensor([[0, 2], [1, 2]])
    weights = torch.rand(2, 2, generator=torch.Generator().manual_seed(1))
    want = moe.moe_experts(x.double(), quant.dequantize(gate_up).double(), quant.dequantize(down).double(),
                           weights.double(), ids)
    assert relative_error(moe_triton.moe_experts(x, gate_up, down, weights, ids), want) <= 1e-5


def test_triton_backend_runs_a_quantized_gguf(tmp_path):
    ref = write_tiny_gguf("qwen3moe", "Q4_K", tmp_path / "model.gguf")
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32", backend="triton")
    assert relative_error(llm.logits(PROMPT[:5]), reference_logits(ref, PROMPT)[:5]) <= 1e-4


def test_a_folder_holding_one_gguf_loads_and_two_are_refused(tmp_path):
    write_tiny_gguf("qwen3", "Q8_0", tmp_path / "a.gguf")
    assert lucebox.LLM(tmp_path, device="cpu", dtype="float32").config.architecture == "Qwen3ForCausalLM"
    shutil.copy(tmp_path / "a.gguf", tmp_path / "b.gguf")
    with pytest.raises(ModelNotFoundError, match="2 .gguf files"):
        lucebox.LLM(tmp_path, device="cpu")


def _rewrite(source, dest, metadata=None, tensor_types=None):
    """A copy of a GGUF file with some metadata values replaced and some tensors re-typed."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(dest, (metadata or {}).get("general.architecture", "qwen3"))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = (metadata or {}).get(name, field.contents())
        if value is not None:
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        kind = (tensor_types or {}).get(t.name)
        if kind is None:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            floats = gguf.quants.dequantize(t.data, t.tensor_type)
            writer.add_tensor(t.name, gguf.quants.quantize(floats, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _one_line_error(args, capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_unsupported_architecture_is_refused_naming_the_key(tmp_path, capsys):
    write_tiny_gguf("qwen3", "Q8_0", tmp_path / "model.gguf")
    _rewrite(tmp_path / "model.gguf", tmp_path / "gpt2.gguf", {"general.architecture": "gpt2"})
    with pytest.raises(UnsupportedArchitectureError, match="general.architecture is 'gpt2'"):
        lucebox.LLM(tmp_path / "gpt2.gguf", device="cpu")
    assert "general.architecture is 'gpt2'" in _one_line_error(["info", str(tmp_path / "gpt2.gguf")], capsys)


def test_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path, capsys):
    write_tiny_gguf("qwen3", "Q8_0", tmp_path / "model.gguf")
    _rewrite(tmp_path / "model.gguf", tmp_path / "tq2_0.gguf",
             tensor_types={"blk.1.attn_v.weight": gguf.GGMLQuantizationType.TQ2_0})
    with pytest.raises(TensorDtypeError, match="tensor blk.1.attn_v.weight is TQ2_0"):
        lucebox.LLM(tmp_path / "tq2_0.gguf", device="cpu")
    err = _one_line_error(["generate", str(tmp_path / "tq2_0.gguf"), "--device", "cpu", "--prompt", "hi"], capsys)
    assert "blk.1.attn_v.weight is TQ2_0" in err and "IQ3_S" in err  # the types that are read, named


def test_missing_metadata_is_refused_naming_the_key(tmp_path):
    write_tiny_gguf("qwen3", "Q8_0", tmp_path / "model.gguf")
    _rewrite(tmp_path / "model.gguf", tmp_path / "broken.gguf", {"qwen3.block_count": None})
    with pytest.raises(ConfigError, match="lacks 'qwen3.block_count'"):
        lucebox.LLM(tmp_path / "broken.gguf", device="cpu")


def test_tokenizer_module_gets_every_key_as_plain_python_values(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    write_tiny_gguf("qwen3", "Q8_0", path)
    seen = {}
    monkeypatch.setattr(gguf_loading, "tokenizer_from_gguf",
                        lambda metadata, source: seen.update(metadata=metadata, source=source))
    lucebox.LLM(path, device="cpu", dtype="float32")
    assert seen["source"] == path
    assert seen["metadata"]["general.architecture"] == "qwen3" and seen["metadata"]["qwen3.block_count"] == 2
    assert type(seen["metadata"]["qwen3.attention.layer_norm_rms_epsilon"]) is float
    monkeypatch.undo()
    assert lucebox.LLM(path, device="cpu", dtype="float32").engine.tokenizer is None  # the file has no tokenizer.ggml.*


def test_lucebox_info_reads_a_gguf(tmp_path, capsys):
    write_tiny_gguf("laguna", "Q4_0", tmp_path / "model.gguf")
    assert main(["info", str(tmp_path / "model.gguf"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "LagunaForCausalLM" and info["layers"] == 4
    assert set(info["gguf_tensor_types"]) == {"F32", "Q4_0"} and sum(info["gguf_tensor_types"].values()) > 20
    assert main(["info", str(tmp_path / "model.gguf")]) == 0
    assert "GGUF tensors: " in capsys.readouterr().out


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_memory_plan_counts_the_weights_as_they_are_held(qtype, tmp_path, capsys):
    """The plan that decides whether a model fits counts a GGUF model's quantized bytes, not 16 bits a weight."""
    write_tiny_gguf("qwen3moe", qtype, tmp_path / "model.gguf")
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32")
    # The fused attention projections (`wqkv`) are the bytes their rows' views wq, wk, wv already count.
    held = sum(w.nbytes() if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()
               for name, w in llm.engine.decoder.w.items() if not name.endswith(".wqkv"))
    assert llm.setup.memory["weights"] == held
    # The VRAM planner and `lucebox info --vram` count them so too, and the expert cache from them.
    assert main(["info", str(tmp_path / "model.gguf"), "--vram", "1GiB", "--dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vram_plan"]["device_bytes"]["weights"] == held
    on_host = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32", experts_on_host=True,
                          expert_slots=2)
    routed = sum(w.nbytes() if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()
                 for name, w in llm.engine.decoder.w.items() if name.endswith(("experts_gate_up", "experts_down")))
    assert on_host.setup.memory["experts_host"] == routed
    assert on_host.setup.memory["weights"] == held - routed + routed * 2 // llm.config.moe.num_experts
    assert on_host.generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids == \
        llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids
