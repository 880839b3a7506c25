"""Random drafters in the public layouts, saved with safetensors, for a given target config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_dflash(folder: Path, target_cfg: dict, layout: str, layers: int = 2, block: int = 8,
                target_layer_ids=(0, 2), seed: int = 0, scale: float = 0.05) -> Path:
    """layout "zlab" (DFlashDraftModel, q/k/v separate, Qwen3-style) or "laguna"
    (DFlashLagunaForCausalLM: fused qkv_proj, g_proj gate, aux_hidden_norms, sliding causal)."""
    g = torch.Generator().manual_seed(seed)
    H, V = target_cfg["hidden_size"], target_cfg["vocab_size"]
    heads, kv, d, inter = 4, 2, 16, 64
    laguna = layout == "laguna"
    config = {
        "architectures": ["DFlashLagunaForCausalLM" if laguna else "DFlashDraftModel"],
        "model_type": "laguna" if laguna else "qwen3", "hidden_size": H, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": d, "intermediate_size": inter, "num_hidden_layers": layers,
        "vocab_size": V, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "block_size": block, "mask_token_id": 3},
    }
    if laguna:
        config.update(layer_types=["sliding_attention"] * layers, sliding_window=16, gating="per-head")
        config["dflash_config"]["causal"] = True

    def w(*shape):
        return torch.randn(*shape, generator=g) * scale

    t = {"fc.weight": w(H, len(target_layer_ids) * H), "hidden_norm.weight": torch.ones(H),
         "norm.weight": torch.ones(H)}
    if laguna:
        t.update({f"aux_hidden_norms.{i}.weight": torch.ones(H) for i in range(len(target_layer_ids))})
    for i in range(layers):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        t[p + "input_layernorm.weight"] = torch.ones(H)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H)
        if laguna:
            t[a + "qkv_proj.weight"] = w((heads + 2 * kv) * d, H)
            t[a + "g_proj.weight"] = w(heads, H)
        else:
            t[a + "q_proj.weight"] = w(heads * d, H)
            t[a + "k_proj.weight"], t[a + "v_proj.weight"] = w(kv * d, H), w(kv * d, H)
        t[a + "o_proj.weight"] = w(H, heads * d)
        t[a + "q_norm.weight"], t[a + "k_norm.weight"] = torch.ones(d), torch.ones(d)
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(inter, H), w(inter, H)
        t[p + "mlp.down_proj.weight"] = w(H, inter)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(t, folder / "model.safetensors")
    return folder


def to_speculators_layout(folder: Path, kind: str = "dflash", rank: int = 8, with_markov: bool = True,
                          scale: float = 0.5, seed: int = 1) -> Path:
    """Rewrite a z-lab drafter folder (`save_dflash(..., "zlab")`) in the Speculators layout, written
    here by hand from the library's documented keys; kind "dspark" adds random Markov and confidence heads."""
    from safetensors.torch import load_file

    zlab = json.loads((folder / "config.json").read_text())
    dflash = zlab.pop("dflash_config")
    zlab.pop("architectures")
    config = {"speculators_model_type": kind, "architectures": ["DSparkSpeculator" if kind == "dspark"
                                                                 else "DFlashSpeculator"],
              "transformer_layer_config": zlab, "draft_vocab_size": zlab["vocab_size"],
              "block_size": dflash["block_size"], "mask_token_id": dflash["mask_token_id"],
              "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
              "sample_from_anchor": False, "speculators_version": "0.9.0"}
    tensors = load_file(folder / "model.safetensors")
    if kind == "dspark":
        g = torch.Generator().manual_seed(seed)
        V, H = zlab["vocab_size"], zlab["hidden_size"]
        config.update(markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=with_markov)
        tensors.update({"markov_head.markov_w1.weight": torch.randn(V, rank, generator=g) * scale,
                        "markov_head.markov_w2.weight": torch.randn(V, rank, generator=g) * scale,
                        "confidence_head.proj.weight": torch.randn(1, H + rank * with_markov, generator=g),
                        "confidence_head.proj.bias": torch.randn(1, generator=g)})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors")
    return folder
