"""Llama (incl. llama3 RoPE scaling). Every layer: full attention, dense MLP."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, require, uniform_layers
from lucebox.models.layout import hf_sources

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported")
    n = int(require(hf, "num_hidden_layers"))
    return ModelConfig(layers=uniform_layers(hf, [None] * n, ["dense"] * n), **common_fields(hf))


sources = hf_sources
