"""Tiny random models written as llama.cpp GGUF files, each with its transformers twin holding the
very weights the file decodes to (by the `gguf` package's own `dequantize`), for parity tests.

The writer follows llama.cpp's converter independently of lucebox's reader: its names, its
metadata keys, and, for architecture `llama`, its interleaving of q/k rows. Float weights and
the block types gguf-py can quantize to (`QUANTIZABLE`) are quantized from the model's random
weights by `gguf.quants.quantize`; the others' blocks are random bytes with sane scales
(`random_blocks`).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from tiny_models import laguna_settings

QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
VOCAB = 128
# Every matrix is 256 inputs wide (or a multiple): K-quant blocks hold 256 weights along a row.
_BASE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")  # what gguf.quants.quantize writes
# (byte offset, typical value) of each float16 scale in a block, so that random codes give weights
# within a few hundredths of zero; MXFP4's one scale is a power-of-two exponent byte instead.
_SCALE_FIELDS = {"Q8_0": ((0, 2e-4),), "Q4_0": ((0, 3e-3),), "Q4_1": ((0, 3e-3), (2, -0.02)),
                 "Q5_0": ((0, 1.5e-3),), "Q5_1": ((0, 1.5e-3), (2, -0.02)), "Q2_K": ((80, 5e-4), (82, 1e-3)),
                 "Q3_K": ((108, 2e-4),), "Q4_K": ((0, 5e-5), (2, 5e-4)), "Q5_K": ((0, 2.5e-5), (2, 5e-4)),
                 "Q6_K": ((208, 1e-5),), "IQ4_NL": ((0, 2e-4),), "IQ4_XS": ((0, 5e-6),), "IQ2_XXS": ((0, 1e-4),),
                 "IQ2_XS": ((0, 1e-4),), "IQ2_S": ((0, 1e-4),), "IQ3_XXS": ((0, 5e-5),), "IQ3_S": ((0, 5e-5),),
                 "MXFP4": ()}
_MXFP4_EXPONENTS = (118, 121)  # scales 2^-10 .. 2^-8 (FP4 values are doubled, up to 12)


def _transformers_model(arch: str):
    import transformers as tf

    if arch == "llama3":  # Llama 3.1's RoPE scaling, which the converter stores as a rope_freqs tensor
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_BASE, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_BASE, attention_bias=True))
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**_BASE, num_local_experts=4, num_experts_per_tok=2))
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**_BASE, tie_word_embeddings=True))
    if arch == "qwen3moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**_BASE, num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=256, norm_topk_prob=True,
                                                        mlp_only_layers=[0]))
    if arch == "laguna":
        return tf.LagunaForCausalLM(tf.LagunaConfig(**laguna_settings(_BASE, 8, 4, 2, 256, 256, 128)))
    raise ValueError(arch)


_GGUF_ARCH = {"mixtral": "llama", "llama3": "llama"}  # what llama.cpp calls them


def llama3_rope_factors(config) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling, as the converter computes them (float32):
    1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    p = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, low, high = p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"]
    factor = p["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _metadata(writer: gguf.GGUFWriter, arch: str, config) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes for this config."""
    gguf_arch = _GGUF_ARCH.get(arch, arch)
    put = {int: writer.add_uint32, float: writer.add_float32, bool: writer.add_bool}
    values = {"block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
              "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
              "attention.head_count_kv": config.num_key_value_heads, "attention.key_length": config.head_dim,
              "attention.value_length": config.head_dim, "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
              "rope.freq_base": float(config.rope_parameters.get("rope_theta", 0.0)),
              "rope.dimension_count": config.head_dim}
    if arch == "mixtral":
        values.update({"expert_count": config.num_local_experts, "expert_used_count": config.num_experts_per_tok})
    if arch == "qwen3moe":
        values.update({"expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
                       "expert_feed_forward_length": config.moe_intermediate_size})
    if arch == "laguna":
        full, sliding = config.rope_parameters["full_attention"], config.rope_parameters["sliding_attention"]
        pattern = (config.layer_types[1:] + ["full_attention"]).index("full_attention") + 1
        values.update({
            "attention.sliding_window": config.sliding_window,
            # one full layer in every `pattern`: the distance to the second full layer (or all of them)
            "attention.sliding_window_pattern": pattern,
            "leading_dense_block_count": config.mlp_layer_types.index("sparse"),
            "expert_count": config.num_experts, "expert_used_count": config.num_experts_per_tok,
            "expert_feed_forward_length": config.moe_intermediate_size,
            "expert_shared_feed_forward_length": config.shared_expert_intermediate_size,
            "expert_weights_norm": True, "expert_weights_scale": float(config.moe_routed_scaling_factor),
            "expert_gating_func": 2, "router_logit_softcapping": float(config.moe_router_logit_softcapping),
            "rope.freq_base": float(full["rope_theta"]),
            "rope.dimension_count": int(config.head_dim * full["partial_rotary_factor"]),
            "rope.freq_base_swa": float(sliding["rope_theta"]),
            "rope.dimension_count_swa": int(config.head_dim * sliding["partial_rotary_factor"])})
        if full["rope_type"] == "yarn":
            values.update({"rope.scaling.factor": float(full["factor"]),
                           "rope.scaling.original_context_length": full["original_max_position_embeddings"]})
            writer.add_string("laguna.rope.scaling.type", "yarn")
        writer.add_array("laguna.attention.head_count", list(config.num_attention_heads_per_layer))
    else:
        values["attention.head_count"] = config.num_attention_heads
    for key, value in values.items():
        put[type(value)](f"{gguf_arch}.{key}", value)


_NAMES = [(r"model\.embed_tokens\.weight", "token_embd.weight"), (r"model\.norm\.weight", "output_norm.weight"),
          (r"lm_head\.weight", "output.weight"), (r"input_layernorm", "attn_norm"),
          (r"post_attention_layernorm", "ffn_norm"), (r"self_attn\.q_proj", "attn_q"), (r"self_attn\.k_proj", "attn_k"),
          (r"self_attn\.v_proj", "attn_v"), (r"self_attn\.o_proj", "attn_output"),
          (r"self_attn\.q_norm", "attn_q_norm"), (r"self_attn\.k_norm", "attn_k_norm"),
          (r"self_attn\.g_proj", "attn_gate"), (r"mlp\.gate\.e_score_correction_bias", "exp_probs_b.bias"),
          (r"mlp\.gate\.weight", "ffn_gate_inp.weight"),
          (r"mlp\.shared_experts\.(\w+)_proj\.weight", r"ffn_\1_shexp.weight"),
          (r"mlp\.experts\.down_proj", "ffn_down_exps.weight"), (r"mlp\.(\w+)_proj", r"ffn_\1"),
          (r"model\.layers\.(\d+)\.", r"blk.\1.")]


def gguf_name(hf_name: str) -> str:
    for pattern, replacement in _NAMES:
        hf_name = re.sub(pattern, replacement, hf_name)
    return hf_name


def _interleave(w: np.ndarray, heads: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order for architecture llama (and its inverse)."""
    D = w.shape[0] // heads
    split = (heads, D // 2, 2) if inverse else (heads, 2, D // 2)
    return w.reshape(*split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, what it decodes to, float32) for weight w in `qtype`."""
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        stored = w.astype(np.float32)
    elif qtype == "F16":
        stored = w.astype(np.float16)
    elif qtype in _SCALE_FIELDS and qtype not in QUANTIZABLE:
        stored = random_blocks(qtype, w.shape[:-1], w.shape[-1], rng)
    else:
        stored = gguf.quants.quantize(w.astype(np.float32), kind)
    decoded = stored.astype(np.float32) if qtype in ("F32", "F16") else gguf.quants.dequantize(stored, kind)
    return stored, decoded


def random_blocks(block_type: str, rows: tuple[int, ...], K: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of one GGUF type for weights (*rows, K), as uint8 (*rows, bytes per row): every
    code and sub-block scale bit random, the float16 scales in a sane range (`_SCALE_FIELDS`)."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[block_type]]
    blocks = rng.integers(0, 256, (*rows, K // block_size, block_bytes), dtype=np.uint8)
    for at, scale in _SCALE_FIELDS[block_type]:
        values = (scale * rng.uniform(0.5, 1.5, blocks.shape[:-1])).astype(np.float16)
        blocks[..., at : at + 2] = values.view(np.uint8).reshape(*blocks.shape[:-1], 2)
    if block_type == "MXFP4":
        blocks[..., 0] = rng.integers(*_MXFP4_EXPONENTS, blocks.shape[:-1])
    return blocks.reshape(*rows, -1)


def _gguf_tensors(model, arch: str, qtype: str):
    """(gguf name, HF name, row slice of the HF tensor, quant type) of every tensor to write."""
    tied = model.config.tie_word_embeddings
    for hf_name, param in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        linear = param.dim() >= 2 and not hf_name.endswith("mlp.gate.weight")  # llama.cpp keeps routers F32
        kind = qtype if linear else "F32"
        if hf_name.endswith("experts.gate_up_proj"):  # transformers fuses gate and up; llama.cpp keeps two
            half = param.shape[1] // 2
            prefix = "blk." + hf_name.split(".")[2] + "."  # model.layers.{i}.mlp.experts.gate_up_proj
            yield prefix + "ffn_gate_exps.weight", hf_name, slice(0, half), kind
            yield prefix + "ffn_up_exps.weight", hf_name, slice(half, None), kind
        else:
            yield gguf_name(hf_name), hf_name, slice(None), kind


def write_tiny_gguf(arch: str, qtype: str, path: Path, seed: int = 0, types: dict[str, str] | None = None):
    """Write a tiny random `arch` model to `path` with its linear weights in `qtype` (`types`
    overrides single GGUF tensors), and return its float64 transformers twin, whose weights are
    exactly what the file decodes to."""
    torch.manual_seed(seed)
    model = _transformers_model(arch).to(torch.float64).eval()
    state = model.state_dict()
    for name in state:  # transformers starts biases at zero, where moving their rows would go unseen
        if name.endswith("e_score_correction_bias"):  # non-zero, so that steering by it is tested
            state[name].copy_(torch.rand_like(state[name]) * 0.2)
        elif name.endswith(".bias"):
            state[name].normal_(0.0, 0.5)
    return write_gguf(model, arch, qtype, path, seed, types)


def write_gguf(model, arch: str, qtype: str, path: Path, seed: int = 0, types: dict[str, str] | None = None,
               more_metadata=None):
    """Write a transformers `model` (float64) to `path` as llama.cpp's converter would, its weights
    replaced by what the file decodes to; `more_metadata(writer)` adds keys (a tokenizer)."""
    rng = np.random.default_rng(seed)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    state = model.state_dict()
    writer = gguf.GGUFWriter(path, _GGUF_ARCH.get(arch, arch))
    _metadata(writer, arch, model.config)
    if more_metadata is not None:
        more_metadata(writer)
    interleaved = _GGUF_ARCH.get(arch, arch) == "llama"
    if arch == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(model.config))
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    for name, hf_name, rows, kind in _gguf_tensors(model, arch, qtype):
        kind = (types or {}).get(name, kind)
        w = state[hf_name][:, rows].numpy() if rows != slice(None) else state[hf_name].numpy()
        head_count = heads.get(name.split(".")[-2]) if interleaved else None
        if head_count:
            w = _interleave(w, head_count)
        stored, decoded = _encode(w, kind, rng)
        raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, stored, raw_dtype=raw)
        if head_count:
            decoded = _interleave(decoded, head_count, inverse=True)
        target = state[hf_name][:, rows] if rows != slice(None) else state[hf_name]
        target.copy_(torch.from_numpy(decoded.astype(np.float64)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def reference_logits(model, prompt: list[int]) -> torch.Tensor:
    """The transformers twin's logits over `prompt`."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]
