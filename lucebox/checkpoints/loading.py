"""From a model folder (or a llama.cpp .gguf file) to a runnable `Decoder`: config, weights (or
random ones), tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.builtin import model_path
from lucebox.checkpoints.gguf.model import GGUFModel, describe_gguf, gguf_tokenizer
from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.checkpoints.quantized import load_quantized, saved_scheme
from lucebox.config import ModelConfig
from lucebox.errors import InvalidArgumentError
from lucebox.kernels.backend import Kernels
from lucebox.kernels.quant import SCHEMES, quantize
from lucebox.limits import LOAD_FORMATS
from lucebox.memory.expert_cache import ExpertTraffic, PinnedArena, cache_experts, is_routed_expert, moved
from lucebox.memory.lm_head import quantize_head
from lucebox.models import adapter_for, build_model_config
from lucebox.models.decoder import Decoder
from lucebox.models.fused_projections import fuse_attention_projections
from lucebox.models.layout import quantizable, stored_dtype, weight_shapes
from lucebox.models.sources import Source, Unloaded
from lucebox.text.tokenizer import Tokenizer
from lucebox.text.tokenizer_files import load_tokenizer


@dataclass
class ModelDescription:
    folder: Path
    hf_config: dict
    generation_config: dict
    cfg: ModelConfig
    quantization: str | None = None  # the scheme of a saved quantized checkpoint (`lucebox quantize`)
    gguf: GGUFModel | None = None  # set when the model is one .gguf file (its folder is `folder`)


@dataclass
class LoadedModel:
    description: ModelDescription
    decoder: Decoder
    tokenizer: Tokenizer | None


def describe_model(path: str | Path | None) -> ModelDescription:
    """Read config.json (and generation_config.json), or a GGUF file's metadata, and normalize it;
    no weights are touched. None, or the built-in model's name, is the built-in model."""
    path = model_path(path)
    gguf = describe_gguf(path)
    if gguf is not None:
        return ModelDescription(gguf.file.path.parent, gguf.hf_config, {}, gguf.model_config(), gguf=gguf)
    config_path = locate_config(path)
    folder = config_path.parent
    hf = read_json(config_path)
    generation = read_json(folder / "generation_config.json", required=False) or {}
    return ModelDescription(folder, hf, generation, build_model_config(hf), saved_scheme(folder))


def dummy_weights(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0, transform=None
) -> dict[str, torch.Tensor]:
    """Random weights at the real shapes (vLLM's load_format='dummy'): N(0, 0.02) matrices, unit
    norms, zero router biases, so activations stay in a realistic range."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            fill = torch.zeros if name.endswith("router_bias") else torch.ones
            weights[name] = fill(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
        if transform is not None:
            weights[name] = transform(name, weights[name])
    return weights


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise InvalidArgumentError(f"load_format '{load_format}' is not one of {', '.join(LOAD_FORMATS)}")


# With tied embeddings an exported lm_head.weight is a copy of the embedding; like transformers, ignore it.
_TIED_LM_HEAD = Unloaded("lm_head.weight", "a copy of the tied embedding", quiet=True)


def checkpoint_sources(desc: ModelDescription) -> tuple[dict[str, Source], tuple[Unloaded, ...]]:
    """Where each of our tensors is in the model's checkpoint, and the checkpoint tensors that may
    be left unread: those the adapter declares (its UNLOADED rules, or `unloaded(cfg)` where they
    depend on the config), and a tied lm_head copy."""
    adapter = adapter_for(desc.hf_config)
    unloaded = tuple(adapter.unloaded(desc.cfg) if hasattr(adapter, "unloaded") else getattr(adapter, "UNLOADED", ()))
    if desc.cfg.tie_word_embeddings:
        unloaded += (_TIED_LM_HEAD,)
    return adapter.sources(desc.cfg), unloaded


def resolve_quantization(asked: str | None, desc: ModelDescription) -> str | None:
    """The weights' scheme: a saved quantized checkpoint's own, which `asked` may only repeat."""
    quantizer(asked)
    if desc.quantization is None or asked in (None, desc.quantization):
        return desc.quantization or asked
    raise InvalidArgumentError(f"{desc.folder} is a saved {desc.quantization} checkpoint; it cannot be loaded as "
                               f"quantization='{asked}': leave quantization unset, or quantize its float source")


def quantizer(scheme: str | None):
    """The per-tensor transform that quantizes the linear layers' weights (None: keep them)."""
    if scheme is None:
        return None
    if scheme not in SCHEMES:
        raise InvalidArgumentError(f"quantization '{scheme}' is not one of {', '.join(SCHEMES)}")

    def transform(name: str, tensor: torch.Tensor):
        if not quantizable(name):
            return tensor
        try:
            return quantize(tensor, scheme)
        except ValueError as e:
            raise InvalidArgumentError(f"cannot quantize {name} to {scheme}: {e}") from None

    return transform


def placement(device: torch.device, experts_on_host: bool, quantization: str | None = None):
    """The per-weight transform of a load: quantize (with `quantization`), then put the routed
    experts in host memory (pinned when a GPU reads them) with `experts_on_host`, the rest on `device`."""
    quantize_weight = quantizer(quantization)
    arena = PinnedArena() if experts_on_host and device.type == "cuda" else None

    def place(name: str, weight):
        if quantize_weight is not None and isinstance(weight, torch.Tensor):  # GGUF blocks stay as they are
            weight = quantize_weight(name, weight)
        if experts_on_host and is_routed_expert(name):
            return moved(weight, "cpu", arena)
        return moved(weight, device)

    return place


def load_model(
    desc: ModelDescription, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
    kernels: Kernels | None = None, quantization: str | None = None, progress=None,
    expert_slots: int | None = None, expert_traffic: ExpertTraffic | None = None, lm_head: str | None = None,
) -> LoadedModel:
    """Weights (quantized as they are read, with `quantization`), tokenizer and a `Decoder` that
    runs on `kernels` (the torch references by default); `progress(done, total)` in bytes read.
    With `expert_slots`, the routed experts stay in host memory and each MoE layer caches that
    many of them on the device, counting its traffic in `expert_traffic` (`lucebox.memory.expert_cache`).
    `lm_head` "int8": the output head as int8 codes (`lucebox.memory.lm_head`)."""
    check_load_format(load_format)
    shapes = weight_shapes(desc.cfg)
    quantization = resolve_quantization(quantization, desc)
    on_host = expert_slots is not None
    transform = placement(device, on_host, quantization)
    cpu = torch.device("cpu")
    # Experts bound for host memory are read there, so a card they do not fit never holds one.
    read_to = (lambda name: cpu if is_routed_expert(name) else device) if on_host else device
    if load_format == "dummy":
        weights = dummy_weights(shapes, dtype, device, transform=transform)
    elif desc.quantization is not None:
        weights = load_quantized(desc.folder, desc.cfg, dtype, placement(device, on_host), progress)
    elif desc.gguf is not None:
        weights = desc.gguf.load_weights(desc.cfg, dtype, read_to, transform, progress)
    else:
        index = CheckpointIndex(weight_files(desc.folder))
        sources, unloaded = checkpoint_sources(desc)
        weights = load_weights(index, sources, shapes, dtype, read_to, unloaded, transform, progress)
    for name in weights:  # routers read in the model dtype are held wider (exactly: a widening cast)
        if stored_dtype(name, dtype) != dtype:
            weights[name] = weights[name].to(stored_dtype(name, dtype))
    quantize_head(weights, desc.cfg, lm_head)
    if on_host:
        cache_experts(weights, len(desc.cfg.layers), expert_slots, device, expert_traffic or ExpertTraffic())
    if desc.gguf is not None:
        tokenizer = gguf_tokenizer(desc.gguf.file)
    else:
        tokenizer = load_tokenizer(desc.folder, desc.hf_config, desc.generation_config, desc.cfg.vocab_size)
    fuse_attention_projections(desc.cfg, weights)  # after quantizing: the fused rows keep their codes
    return LoadedModel(desc, Decoder(desc.cfg, weights, kernels), tokenizer)
