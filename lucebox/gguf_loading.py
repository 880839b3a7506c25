"""A llama.cpp GGUF model as lucebox loads it: the file, the config.json its metadata translates
to, its weights, and its tokenizer (`lucebox.gguf_tokenizer`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.config import ModelConfig
from lucebox.gguf_config import hf_config_from_gguf
from lucebox.gguf_file import GGUFFile, locate_gguf
from lucebox.gguf_tokenizer import tokenizer_from_gguf
from lucebox.gguf_weights import device_bytes, load_gguf_weights
from lucebox.memory_plan import StoredWeights


@dataclass
class GGUFModel:
    file: GGUFFile
    hf_config: dict

    @property
    def architecture(self) -> str:
        return str(self.file.metadata["general.architecture"])

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
