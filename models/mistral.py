"""Mistral: Llama with a sliding window on every layer (4096 when config.json omits it; null turns it off)."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, require, uniform_layers
from lucebox.models.layout import hf_sources

from lucebox.config import ModelConfig

ARCHITECTURES = ("MistralForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    window = hf.get("sliding_window", 4096)  # transformers' MistralConfig default when the key is absent
    return ModelConfig(layers=uniform_layers(hf, [window] * n, ["dense"] * n), **common_fields(hf))


sources = hf_sources
