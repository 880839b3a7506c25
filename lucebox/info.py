"""What `lucebox info` reports about a model, from config.json alone."""

from __future__ import annotations

from collections import Counter

from lucebox.config import ModelConfig
from lucebox.models.layout import parameter_counts


def model_summary(cfg: ModelConfig, kv_dtype_bytes: int = 2, kv_int8: bool = False) -> dict:
    """Parameter counts, layer layout, and KV-cache bytes per token for each attention kind (with
    `kv_int8`, full layers' rows as the int8 pool stores them; sliding rings keep `kv_dtype_bytes`)."""
    total, active = parameter_counts(cfg)
    kinds = Counter((layer.attention, layer.window, layer.num_heads) for layer in cfg.layers)
    attention = []
    for (kind, window, heads), count in sorted(kinds.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        per_token = cfg.kv_bytes_per_token(kv_dtype_bytes, kv_int8 and kind == "full")
        attention.append({
            "kind": kind, "layers": count, "query_heads": heads, "window": window,
            "kv_bytes_per_token_per_layer": per_token,
            # A sliding layer never holds more than `window` rows, whatever the context.
            "kv_bytes_max_per_layer": per_token * window if window else None,
        })
    mlp = Counter(layer.mlp for layer in cfg.layers)
    summary = {
        "architecture": cfg.architecture,
        "parameters_total": total,
        "parameters_active": active,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "attention": attention,
        "mlp": {"dense": mlp.get("dense", 0), "moe": mlp.get("moe", 0)},
        "kv_dtype_bytes": kv_dtype_bytes,
        "layer_pattern": "".join("F" if layer.attention == "full" else "S" for layer in cfg.layers),
    }
    if cfg.moe is not None:
        m = cfg.moe
        summary["moe"] = {"experts": m.num_experts, "top_k": m.top_k, "expert_size": m.expert_size,
                          "shared_expert_size": m.shared_expert_size, "router": m.router}
    return summary
