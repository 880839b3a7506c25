"""The LM head's format: the float table, or int8 codes with one float16 scale per vocabulary row.

A decode step reads the whole head (V x H): with int4 experts and a bfloat16 head it is about a
fifth of the bytes a token reads at 1K of context. For quantized models the planner therefore
holds the head as int8 where the kernels read the codes themselves (Triton); the torch reference
keeps a dense copy on the CPU (`kernels.quant.kept_dense`), so there the int8 head would read as
many bytes and only cost host memory and accuracy, and the float head is kept.

With tied embeddings the float table stays for the embedding lookup (a token's own row, exact) and
the int8 head is a second, smaller copy the logits read (`"lm_head"` beside `"embed"`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lucebox.config import ModelConfig
from lucebox.errors import InvalidArgumentError
from lucebox.kernels.quant import QuantizedTensor, quantize, quantized_bytes
from lucebox.limits import LM_HEADS

HEAD_SCHEME = "int8"  # per output row: group = the whole hidden width (`kernels.quant.default_group`)
_BACKENDS_READING_CODES = ("triton",)


def head_shape(cfg: ModelConfig) -> tuple[int, int]:
    return (cfg.vocab_size, cfg.hidden_size)


def float_head_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return math.prod(head_shape(cfg)) * dtype.itemsize


def int8_head_bytes(cfg: ModelConfig) -> int:
    """Codes and per-row scales: what one step's logits read from an int8 head."""
    return quantized_bytes(head_shape(cfg), HEAD_SCHEME)


def choose_lm_head(asked: str, quantization: str | None, backend: str, cfg: ModelConfig, dtype: torch.dtype,
                   gguf: bool = False, on_gpu: bool = False) -> str | None:
    """"int8" or None (the float head). `asked` (EngineConfig.lm_head): "float" keeps the float head,
    "int8" asks for codes, "auto" picks int8 for quantized weights when the backend reads codes
    and the codes are fewer bytes than the float head. A GGUF file's head stays as the file has it."""
    if asked not in LM_HEADS:
        raise InvalidArgumentError(f"lm_head '{asked}' is not one of {', '.join(LM_HEADS)}")
    if gguf and asked == HEAD_SCHEME:
        raise InvalidArgumentError("lm_head='int8' is for Hugging Face weights; a GGUF file's output head is "
                                   "kept in the form the file stores it: leave lm_head 'auto' or 'float'")
    if asked == HEAD_SCHEME and on_gpu and backend not in _BACKENDS_READING_CODES:
        raise InvalidArgumentError(f"lm_head='int8' on the GPU needs a backend whose kernels read the codes "
                                   f"({', '.join(_BACKENDS_READING_CODES)}); the {backend} backend would rebuild "
                                   f"the float head at every step: use backend='triton' or lm_head 'float'")
    if asked == HEAD_SCHEME:
        return HEAD_SCHEME
    saves = int8_head_bytes(cfg) < float_head_bytes(cfg, dtype)
    if asked == "auto" and quantization and not gguf and backend in _BACKENDS_READING_CODES and saves:
        return HEAD_SCHEME
    return None


def head_weight_bytes(cfg: ModelConfig, dtype: torch.dtype, lm_head: str | None) -> int:
    """Bytes the weights hold beyond the float layout (`models.layout.weight_shapes`) for this head:
    untied, the int8 head replaces the float one (fewer bytes, so negative); tied, it is held beside
    the float table the embedding reads."""
    if lm_head is None:
        return 0
    if cfg.tie_word_embeddings:
        return int8_head_bytes(cfg)
    return int8_head_bytes(cfg) - float_head_bytes(cfg, dtype)


def head_dense_copy_bytes(cfg: ModelConfig, dtype: torch.dtype, lm_head: str | None) -> int:
    """The dense copy the CPU keeps of an int8 head (`kernels.quant.kept_dense`)."""
    return 0 if lm_head is None else float_head_bytes(cfg, dtype)


def quantize_head(weights: dict, cfg: ModelConfig, lm_head: str | None) -> None:
    """Give `weights` the head `lm_head` names: with int8, `weights["lm_head"]` becomes the codes of
    the float head (of the embedding table when tied, which stays for the lookup)."""
    if lm_head is None:
        return
    source = weights["embed"] if cfg.tie_word_embeddings else weights["lm_head"]
    if isinstance(source, QuantizedTensor):
        raise InvalidArgumentError("lm_head='int8' needs a float output head; this checkpoint stores it quantized")
    # Quantized on the host: the rounding's float32 temporaries (three copies of the head) would
    # otherwise need device memory the plan does not hold.
    codes = quantize(source.cpu(), HEAD_SCHEME)
    weights["lm_head"] = replace(codes, codes=codes.codes.to(source.device), scales=codes.scales.to(source.device))
