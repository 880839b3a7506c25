"""Tensors of llama.cpp's Gated DeltaNet hybrids: `qwen3next` (Qwen3-Next), `qwen35` (Qwen3.5) and
`qwen35moe` (Qwen3.5-MoE), mapped to ours and with the converter's transforms undone.

What llama.cpp's converter (convert_hf_to_gguf.py: Qwen3NextModel, _LinearAttentionVReorderBase,
Qwen3_5TextModel, Qwen3_5MoeTextModel; names from gguf-py's tensor_mapping.py) writes, per block:
  attn_norm (input_layernorm), post_attention_norm (post_attention_layernorm: not ffn_norm), and
  output_norm, attn_q_norm, attn_k_norm: stored as 1 + w (the converter adds 1 to every
  "*norm.weight" but linear_attn.norm, because llama.cpp's RMSNorm scales by the stored weight);
  full attention layers: attn_q (q and its sigmoid gate, per head, unchanged), attn_k, attn_v,
  attn_output; MoE: ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_{gate,up,down}_shexp and
  ffn_gate_inp_shexp (shared_expert_gate);
  Gated DeltaNet layers (linear_attn.*):
    ssm_a       = -exp(A_log)                       [Hv]
    ssm_dt.bias = dt_bias                           [Hv]
    ssm_conv1d  = conv1d.weight squeezed to         [C, K]
    ssm_norm    = norm.weight, as is                [Dv]
    ssm_out     = out_proj                          [H, Hv*Dv]
  qwen3next:  in_proj_qkvz (rows grouped by key head: q, k, then its r = Hv/Hk value heads' v and
    z) split into attn_qkv (all q, all k, all v) and attn_gate (all z); files of older converters
    hold it whole as ssm_in. in_proj_ba stays grouped, as ssm_ba.
  qwen35, qwen35moe: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a become attn_qkv, attn_gate,
    ssm_beta, ssm_alpha; and when Hk != Hv the value heads move from grouped order (key head g's r
    heads together: g*r + i) to tiled order (i*Hk + g), in the v rows of attn_qkv, attn_gate,
    ssm_beta, ssm_alpha, ssm_a, ssm_dt, the v channels of ssm_conv1d and the input columns of
    ssm_out (so that ggml's broadcast of the key heads lines up).
Every move is undone by an index: rows of quantized weights move whole; ssm_out's columns move a
value head (Dv columns, whole quantization groups) at a time, so it stays quantized.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lucebox.checkpoints.gguf.reorder import GGUFSource
from lucebox.config import ModelConfig

HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
_OFFSET_NORMS = ("norm", "attn_norm", "mlp_norm", "q_norm", "k_norm")


def hybrid_sources(cfg: ModelConfig, arch: str, common: dict[str, GGUFSource], has) -> dict[str, GGUFSource]:
    """`common` (the names every architecture shares) adapted to a hybrid, plus each Gated DeltaNet
    layer's own tensors; `has(name)` tells which of the converter's layouts the file holds."""
    sources = {}
    for name, source in common.items():
        part = name.rsplit(".", 1)[-1]
        if part == "mlp_norm":
            source = replace(source, names=(source.names[0].replace("ffn_norm", "post_attention_norm"),))
        sources[name] = replace(source, value="offset_norm") if part in _OFFSET_NORMS else source
    for i, layer in enumerate(cfg.layers):
        if layer.is_recurrent:
            sources.update(_gated_deltanet(cfg, f"layers.{i}.gdn_", f"blk.{i}.", arch, has))
    return sources


def _spread(heads: torch.Tensor, width: int) -> torch.Tensor:
    """Row indices of whole heads `width` rows each, in the order `heads` lists them."""
    return (heads[:, None] * width + torch.arange(width)).reshape(-1)


def _gated_deltanet(cfg: ModelConfig, p: str, b: str, arch: str, has) -> dict[str, GGUFSource]:
    s = cfg.linear_attention
    qkv_z, shares = (b + "attn_qkv.weight", b + "attn_gate.weight"), (s.conv_channels, s.value_heads * s.value_dim)
    sources = {"conv": GGUFSource((b + "ssm_conv1d.weight",), any_shape=True),
               "norm": GGUFSource((b + "ssm_norm.weight",)), "out": GGUFSource((b + "ssm_out.weight",)),
               "dt_bias": GGUFSource((b + "ssm_dt.bias",)), "A_log": GGUFSource((b + "ssm_a",), value="negated_exp")}
    if arch == "qwen3next":
        sources["ba"] = GGUFSource((b + "ssm_ba.weight",))
        sources["qkvz"] = (GGUFSource((b + "ssm_in.weight",)) if has(b + "ssm_in.weight") else
                           GGUFSource(qkv_z, rows=_grouped_qkvz(s), part_rows=shares))
    else:
        sources["ba"] = GGUFSource((b + "ssm_beta.weight", b + "ssm_alpha.weight"))
        sources["qkvz"] = GGUFSource(qkv_z, part_rows=shares)
        if s.key_heads != s.value_heads:
            sources = _untiled(sources, s)
    return {p + part: source for part, source in sources.items()}


def _grouped_qkvz(s) -> torch.Tensor:
    """attn_qkv | attn_gate rows back in in_proj_qkvz's order: for each key head g, its q, its k,
    then the v and z of its r value heads."""
    Hk, Dk, rDv = s.key_heads, s.key_dim, s.value_heads // s.key_heads * s.value_dim
    qk, v, g = 2 * Hk * Dk, s.value_heads * s.value_dim, torch.arange(Hk)
    runs = [_spread(g, Dk), Hk * Dk + _spread(g, Dk), qk + _spread(g, rDv), qk + v + _spread(g, rDv)]
    return torch.cat([run.view(Hk, -1) for run in runs], dim=1).reshape(-1)


def _untiled(sources: dict[str, GGUFSource], s) -> dict[str, GGUFSource]:
    """Qwen3.5's value heads back from tiled to grouped order: our head j = g*r + i is the file's
    i*Hk + g, in every tensor that has a row (or, for ssm_out, a column block) per value head."""
    Hk, Hv, Dv, r = s.key_heads, s.value_heads, s.value_dim, s.value_heads // s.key_heads
    heads = (torch.arange(Hv) % r) * Hk + torch.arange(Hv) // r
    qk, v = 2 * Hk * s.key_dim, Hv * Dv
    moved = {"qkvz": torch.cat([torch.arange(qk), qk + _spread(heads, Dv), qk + v + _spread(heads, Dv)]),
             "conv": torch.cat([torch.arange(qk), qk + _spread(heads, Dv)]),
             "ba": torch.cat([heads, Hv + heads]), "dt_bias": heads, "A_log": heads}
    sources = {part: replace(source, rows=moved[part]) if part in moved else source
               for part, source in sources.items()}
    sources["out"] = replace(sources["out"], column_blocks=heads, block_width=Dv)
    return sources
