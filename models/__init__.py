"""Architecture adapters: each maps a Hugging Face config.json onto a `ModelConfig` and names where
its tensors live in the checkpoint. The engine itself never looks at the architecture name."""

from __future__ import annotations

from types import ModuleType

from lucebox.models import laguna, llama, mistral, mixtral, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next
from lucebox.models.hf_config import architecture_name, check_values

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError, UnsupportedArchitectureError

_MODULES = (laguna, llama, mistral, mixtral, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next)
SUPPORTED_ARCHITECTURES = tuple(sorted(arch for module in _MODULES for arch in module.ARCHITECTURES))
# An adapter may also claim names it refuses with its own message (REFUSED_ARCHITECTURES: the
# image-text Qwen3.5 checkpoints), rather than the generic "not supported" below.
_ADAPTERS: dict[str, ModuleType] = {
    arch: module for module in _MODULES
    for arch in (*module.ARCHITECTURES, *getattr(module, "REFUSED_ARCHITECTURES", ()))
}


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
    check_values(hf_config)
    try:
        return adapter.build_config(hf_config)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"config.json has a value of the wrong type or form ({type(e).__name__}: {e})") from None
