"""Mistral: Llama with an optional sliding window on every layer."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, require, uniform_layers
from lucebox.models.layout import hf_sources

from lucebox.config import ModelConfig

ARCHITECTURES = ("MistralForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    window = hf.get("sliding_window")
    return ModelConfig(layers=uniform_layers(hf, [window] * n, ["dense"] * n), **common_fields(hf))


sources = hf_sources
