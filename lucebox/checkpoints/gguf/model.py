"""A llama.cpp GGUF model as lucebox loads it: the file, the config.json its metadata translates
to, its weights, and its tokenizer (`lucebox.checkpoints.gguf.tokenizer`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.checkpoints.gguf.config import hf_config_from_gguf, in_gguf_terms
from lucebox.checkpoints.gguf.file import GGUFFile, locate_gguf
from lucebox.checkpoints.gguf.tokenizer import tokenizer_from_gguf
from lucebox.checkpoints.gguf.weights import ROPE_FREQS, device_bytes, load_gguf_weights
from lucebox.config import ModelConfig
from lucebox.errors import ConfigError
from lucebox.memory.plan import StoredWeights
from lucebox.models import build_model_config


@dataclass
class GGUFModel:
    file: GGUFFile
    hf_config: dict

    @property
    def architecture(self) -> str:
        return str(self.file.metadata["general.architecture"])

    def model_config(self) -> ModelConfig:
        """The normalized config; a `rope_freqs` tensor (how llama.cpp's converter stores Llama 3's
        RoPE scaling) divides every full-rotary layer's frequencies."""
        with in_gguf_terms(self.file.path, self.architecture):
            cfg = build_model_config(self.hf_config)
        if ROPE_FREQS not in self.file:
            return cfg
        factors = tuple(self.file.read(ROPE_FREQS, torch.float32, torch.device("cpu")).tolist())
        layers = []
        for layer in cfg.layers:
            if len(factors) != layer.rope.rotary_dim // 2:
                raise ConfigError(f"{self.file.path.name}: tensor {ROPE_FREQS} holds {len(factors)} factors, the "
                                  f"rotary dimension {layer.rope.rotary_dim} needs {layer.rope.rotary_dim // 2}")
            layers.append(dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, freq_factors=factors)))
        return dataclasses.replace(cfg, layers=tuple(layers))

    def device_bytes(self, cfg: ModelConfig, dtype: torch.dtype) -> StoredWeights:
        return device_bytes(self.file, cfg, self.architecture, dtype)

    def load_weights(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, transform=None,
                     progress=None) -> dict:
        return load_gguf_weights(self.file, cfg, self.architecture, dtype, device, transform, progress)


def describe_gguf(path: str | Path) -> GGUFModel | None:
    """The GGUF model at `path` (a .gguf file, or a folder holding exactly one), or None."""
    found = locate_gguf(path)
    if found is None:
        return None
    file = GGUFFile(found)
    return GGUFModel(file, hf_config_from_gguf(file.metadata, file.__contains__, file.shape, found))


def gguf_tokenizer(file: GGUFFile):
    """The tokenizer the file's tokenizer.ggml.* metadata describes (None without one)."""
    return tokenizer_from_gguf(file.metadata, file.path)
