"""A llama.cpp GGUF model as lucebox loads it: the file, the config.json its metadata translates
to, its weights, and its tokenizer (`lucebox.checkpoints.gguf.tokenizer`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.checkpoints.gguf.config import hf_config_from_gguf, in_gguf_terms
from lucebox.checkpoints.gguf.file import FLOAT_TYPES, GGUFFile, locate_gguf
from lucebox.checkpoints.gguf.tokenizer import tokenizer_from_gguf
from lucebox.checkpoints.gguf.weights import ROPE_FREQS, device_bytes, load_gguf_weights
from lucebox.config import ModelConfig
from lucebox.errors import TensorShapeError
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
        factors = self._rope_freq_factors(cfg)
        layers = [dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, freq_factors=factors))
                  for layer in cfg.layers]
        return dataclasses.replace(cfg, layers=tuple(layers))

    def _rope_freq_factors(self, cfg: ModelConfig) -> tuple[float, ...]:
        """The rope_freqs divisors, read on the host into a Python tuple once the index shows what
        they must be: one float per rotary frequency pair, the same for every layer."""
        entry = self.file.tensors[ROPE_FREQS]
        pairs = {layer.rope.rotary_dim // 2 for layer in cfg.layers}
        expected = (pairs.pop(),) if len(pairs) == 1 else None
        if entry.shape != expected or entry.type_name not in FLOAT_TYPES:
            needs = (f"shape {list(expected)} (one factor per rotary frequency pair)" if expected else
                     "one shape, but the layers' rotary dimensions differ")
            raise TensorShapeError(f"{self.file.path.name}: tensor {ROPE_FREQS} is {entry.type_name} "
                                   f"{list(entry.shape)}; lucebox needs a float tensor ({', '.join(FLOAT_TYPES)}) "
                                   f"of {needs}; re-convert the model")
        return tuple(self.file.read(ROPE_FREQS, torch.float32, torch.device("cpu")).tolist())

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
