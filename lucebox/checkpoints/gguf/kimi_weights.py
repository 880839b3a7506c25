"""Tensors of llama.cpp's `kimi-linear` (Kimi Linear), mapped to ours with the converter's
transforms undone.

What llama.cpp's converter (convert_hf_to_gguf.py KimiLinearModel.modify_tensors; names from gguf-py's
tensor_mapping.py) writes, and src/models/kimi-linear.cpp reads, per block: attn_norm, ffn_norm
(post_attention_layernorm), output_norm, all as they are (no 1 + w); the dense first layers'
ffn_gate/up/down; MoE layers' ffn_gate_inp, exp_probs_b.bias (e_score_correction_bias),
ffn_{gate,up,down}_exps (w1, w3, w2 stacked) and ffn_{gate,up,down}_shexp.
  KDA layers (self_attn.*):
    attn_q, attn_k, attn_v, attn_output           q/k/v/o_proj
    ssm_conv1d_q, _k, _v  = q/k/v_conv1d reshaped  (1, H*D, 1, K)  (ggml [K, 1, H*D, 1])
    ssm_f_a, ssm_f_b, ssm_g_a, ssm_g_b, ssm_beta   f_a/f_b/g_a/g_b/b_proj
    ssm_a       = -exp(A_log)                      (1, 1, H, 1)   (llama.cpp also takes [1, H])
    ssm_dt.bias = dt_bias                          [H*D]
    ssm_norm    = o_norm                           [D]
  MLA layers: attn_q (or attn_q_a, attn_q_a_norm, attn_q_b), attn_kv_a_mqa, attn_kv_a_norm,
    attn_output, and kv_b_proj split per head for llama.cpp's absorbed MLA: attn_k_b = its nope
    rows, transposed (H, kv_lora_rank, nope), attn_v_b = its value rows (H, v, kv_lora_rank).
    Files that keep it whole (attn_kv_b, MLA cache off in llama.cpp) load too.
attn_k_b's rows run along nope, not the latent, so its blocks cannot move whole: kv_b is rebuilt
in floats (`joined_kv_b`). The other projections stay quantized (`weights.keeps_blocks`).
"""

from __future__ import annotations

from lucebox.checkpoints.gguf.reorder import GGUFSource
from lucebox.config import ModelConfig

KIMI_ARCHITECTURES = ("kimi-linear",)

_KDA = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight", "f_a": "ssm_f_a.weight",
        "f_b": "ssm_f_b.weight", "dt_bias": "ssm_dt.bias", "b": "ssm_beta.weight", "g_a": "ssm_g_a.weight",
        "g_b": "ssm_g_b.weight", "norm": "ssm_norm.weight", "out": "attn_output.weight"}
_MLA = {"wkv_a": "attn_kv_a_mqa.weight", "kv_a_norm": "attn_kv_a_norm.weight", "wo": "attn_output.weight"}
_Q_LATENT = {"wq_a": "attn_q_a.weight", "q_a_norm": "attn_q_a_norm.weight", "wq_b": "attn_q_b.weight"}


def kimi_sources(cfg: ModelConfig, common: dict[str, GGUFSource], has) -> dict[str, GGUFSource]:
    """`common` (norms, MLPs, embeddings) plus each layer's KDA or MLA tensors; `has(name)` tells
    whether a file keeps kv_b whole."""
    sources = dict(common)
    for i, layer in enumerate(cfg.layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        own = _kda(b) if layer.is_recurrent else _latent(cfg, layer.num_heads, b, has)
        sources.update({p + name: source for name, source in own.items()})
    return sources


def _kda(b: str) -> dict[str, GGUFSource]:
    sources = {"kda_" + ours: GGUFSource((b + theirs,)) for ours, theirs in _KDA.items()}
    sources["kda_conv"] = GGUFSource(tuple(f"{b}ssm_conv1d_{x}.weight" for x in "qkv"), any_shape=True)
    sources["kda_A_log"] = GGUFSource((b + "ssm_a",), value="negated_exp", any_shape=True)
    return sources


def _latent(cfg: ModelConfig, heads: int, b: str, has) -> dict[str, GGUFSource]:
    mla = cfg.latent_attention
    names = _MLA | (_Q_LATENT if mla.q_rank else {"wq": "attn_q.weight"})
    sources = {ours: GGUFSource((b + theirs,)) for ours, theirs in names.items()}
    if has(b + "attn_kv_b.weight"):
        sources["wkv_b"] = GGUFSource((b + "attn_kv_b.weight",))
    else:
        shapes = ((heads, mla.kv_rank, mla.nope_dim), (heads, mla.value_dim, mla.kv_rank))
        sources["wkv_b"] = GGUFSource((b + "attn_k_b.weight", b + "attn_v_b.weight"), part_shapes=shapes,
                                      joined="kv_b")
    return sources
