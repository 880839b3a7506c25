"""Mixtral: Mistral attention (optional sliding window), softmax top-k router, experts w1/w3/w2."""

from __future__ import annotations

import dataclasses
from functools import partial

from lucebox.models.hf_config import common_fields, require, softmax_moe, uniform_layers
from lucebox.models.layout import MoENames, hf_sources

from lucebox.config import ModelConfig

ARCHITECTURES = ("MixtralForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    moe = dataclasses.replace(softmax_moe(hf, ("num_local_experts", "num_experts"), normalize=True),
                              float32_weights=True)
    window = hf.get("sliding_window")
    return ModelConfig(layers=uniform_layers(hf, [window] * n, ["moe"] * n), moe=moe, **common_fields(hf))


sources = partial(hf_sources, moe_names=MoENames(block="block_sparse_moe", gate="w1", up="w3", down="w2"))
