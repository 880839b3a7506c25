"""Where each of our tensors lies in a GGUF file (`GGUFSource`), and the exact inverses of the
moves and value changes llama.cpp's converter makes: row and column reorders, which keep quantized
blocks intact, and the few value transforms of small float tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.errors import CorruptCheckpointError, TensorShapeError
from lucebox.kernels.quant import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor


@dataclass(frozen=True)
class GGUFSource:
    names: tuple[str, ...]  # GGUF tensors, concatenated along the output rows
    heads: int = 0  # > 0: undo the rotary interleave of this many heads' rows
    rows: torch.Tensor | None = None  # then our row r is the concatenation's row rows[r]
    column_blocks: torch.Tensor | None = None  # our block b of input columns is the file's block [b]
    block_width: int = 0  # input columns per block of `column_blocks`
    value: str | None = None  # a value transform to undo (`undo_value`)
    any_shape: bool = False  # the file may hold our values in another shape with as many elements
    part_rows: tuple[int, ...] | None = None  # rows of each name (None: equal shares)
    part_shapes: tuple[tuple[int, ...], ...] | None = None  # each name's exact shape, when not a share of ours
    joined: str | None = None  # the parts are joined by `JOINS[joined]`, not concatenated along rows


def rotary_halves_order(rows: int, heads: int) -> torch.Tensor:
    """Row indices that turn llama.cpp's interleaved rotary layout back into halves: in each head
    of D rows, our row h * D + j (j < D/2: first half, else second) is its row h * D + 2 * (j mod
    D/2) + (j >= D/2)."""
    D = rows // heads
    within = torch.arange(D).view(D // 2, 2).t().reshape(-1)
    return (torch.arange(heads)[:, None] * D + within).reshape(-1)


def take_rows(w: Weight, order: torch.Tensor) -> Weight:
    """w with its output rows (dim -2 of a matrix, dim 0 of a vector) reordered; quantized blocks
    run along the input features, so whole rows move intact."""
    if isinstance(w, QuantizedTensor):
        pick = order.to(w.codes.device)
        mins = None if w.mins is None else w.mins.index_select(-2, pick)
        zeros = None if w.zeros is None else w.zeros.index_select(-2, pick)
        return QuantizedTensor(w.codes.index_select(-2, pick), w.scales.index_select(-2, pick), zeros, w.bits,
                               w.group, w.shape, w.dtype, mins)
    return w.index_select(-2 if w.dim() > 1 else 0, order.to(w.device))


def take_column_blocks(w: Weight, order: torch.Tensor, width: int, name: str) -> Weight:
    """w with its input columns reordered in blocks of `width` (our block b is w's block order[b]).
    A quantized w keeps its codes when `width` holds whole quantization groups, as a head of
    Qwen3.5's 128 values holds whole 32- (or 16-) wide groups; otherwise it is refused."""
    def blocks(t: torch.Tensor, per_block: int) -> torch.Tensor:
        lead = t.shape[:-1]
        picked = t.reshape(*lead, -1, per_block).index_select(-2, order.to(t.device))
        return picked.reshape(*lead, -1).contiguous()

    if not isinstance(w, QuantizedTensor):
        return blocks(w, width)
    if width % w.group:
        raise TensorShapeError(f"{name}: its columns move in blocks of {width}, which split its quantization groups "
                         f"of {w.group}")
    codes = blocks(w.codes, width // 2 if w.bits == 4 else width)
    groups = width // w.group
    mins = None if w.mins is None else blocks(w.mins, groups)
    zeros = None if w.zeros is None else blocks(w.zeros, groups)
    return QuantizedTensor(codes, blocks(w.scales, groups), zeros, w.bits, w.group, w.shape, w.dtype, mins)


# The converter's value changes of small float tensors, and their inverses:
#   "offset_norm": RMSNorm weights stored as 1 + w (llama.cpp scales by the weight as stored);
#   "negated_exp": A_log stored as A = -exp(A_log) (llama.cpp multiplies the decay by A).
_INVERSES = {"offset_norm": lambda w: w - 1, "negated_exp": lambda w: torch.log(-w)}


def undo_value(w: torch.Tensor, value: str, name: str) -> torch.Tensor:
    if value == "negated_exp" and not bool((w < 0).all()):
        raise CorruptCheckpointError(f"{name} holds values >= 0; llama.cpp stores -exp(A_log) there, which is "
                                     "always negative: re-convert the model")
    return _INVERSES[value](w)


def joined_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """MLA's kv_b (H*(nope + v), kv_rank) from llama.cpp's absorbed split: k_b (H, kv_rank, nope), the
    nope rows of each head transposed, and v_b (H, v, kv_rank); each head's nope rows, then its v rows."""
    return torch.cat([k_b.transpose(-1, -2), v_b], dim=-2).reshape(-1, v_b.shape[-1])


JOINS = {"kv_b": joined_kv_b}  # joins of float parts (quantized ones are dequantized first)
