"""Architecture adapters: each maps a Hugging Face config.json onto a `ModelConfig` and names where
its tensors live in the checkpoint. The engine itself never looks at the architecture name.

An adapter module has ARCHITECTURES, `build_config(hf)` and `sources(cfg)`; optionally
`text_model_fields(hf)` (an image-text config.json's text model fields, which `build_config` then
reads) and UNLOADED (`Unloaded` rules: checkpoint tensors it knowingly does not load, e.g. an MTP
head or a vision tower; any other tensor no source reads stops the load), or `unloaded(cfg)` where
the rules depend on the config."""

from __future__ import annotations

from types import ModuleType

from lucebox.models import (
    glm4_moe,
    kimi_linear,
    laguna,
    llama,
    mistral,
    mixtral,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from lucebox.models.hf_config import architecture_name, check_values

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError, UnsupportedArchitectureError

_MODULES = (glm4_moe, kimi_linear, laguna, llama, mistral, mixtral, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next)
SUPPORTED_ARCHITECTURES = tuple(sorted(arch for module in _MODULES for arch in module.ARCHITECTURES))
_ADAPTERS: dict[str, ModuleType] = {arch: module for module in _MODULES for arch in module.ARCHITECTURES}


def adapter_for(hf_config: dict) -> ModuleType:
    name = architecture_name(hf_config)
    module = _ADAPTERS.get(name)
    if module is None:
        raise UnsupportedArchitectureError(
            f"architecture '{name}' is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return module


def build_model_config(hf_config: dict) -> ModelConfig:
    """The normalized config of a config.json; any malformed value becomes a ConfigError."""
    adapter = adapter_for(hf_config)
    if hasattr(adapter, "text_model_fields"):
        hf_config = adapter.text_model_fields(hf_config)
    check_values(hf_config)
    try:
        return adapter.build_config(hf_config)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"config.json has a value of the wrong type or form ({type(e).__name__}: {e})") from None
