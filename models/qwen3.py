"""Qwen3 (dense): QK RMSNorm; sliding window on the layers `layer_types` (or max_window_layers) marks."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, require, uniform_layers
from lucebox.models.layout import hf_sources

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError

ARCHITECTURES = ("Qwen3ForCausalLM",)


def sliding_windows(hf: dict, n: int) -> list[int | None]:
    """Per-layer windows the way Qwen configs state them: layer_types, else use_sliding_window."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    kinds = hf.get("layer_types")
    if kinds is None:
        first = hf.get("max_window_layers", n)
        kinds = ["sliding_attention" if window and i >= first else "full_attention" for i in range(n)]
    if len(kinds) != n:
        raise ConfigError(f"config.json: layer_types has {len(kinds)} entries for {n} layers")
    if any(k == "sliding_attention" for k in kinds) and not hf.get("sliding_window"):
        raise ConfigError("config.json: layer_types names sliding layers but sliding_window is not set")
    return [hf["sliding_window"] if k == "sliding_attention" else None for k in kinds]


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    return ModelConfig(
        layers=uniform_layers(hf, sliding_windows(hf, n), ["dense"] * n), qk_norm=True, **common_fields(hf)
    )


sources = hf_sources
