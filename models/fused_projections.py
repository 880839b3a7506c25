"""One weight for an attention layer's input projections, made once when a model is loaded.

A decode step reads every weight once per token, so q, k, v (and the softplus gate's projection)
as one linear over their rows concatenated is one launch instead of three or four, moving the
same bytes. The fused weight is `layers.{i}.wqkv` (its bias `bqkv`), rows in the order wq, wk, wv,
wg; the original names stay in the dict as views of its rows, so whatever reads them by name
(training, a saved checkpoint's comparison, memory accounting by storage) sees what it always
did and the bytes are held once. Quantized weights fuse when their layouts agree (bits, group,
zero points, mins), or on the CPU as one dense weight of their kept dense copies; otherwise the
layer keeps its separate linears.
"""

from __future__ import annotations

import torch
from lucebox.kernels.quant import QuantizedTensor, kept_dense

from lucebox.config import ModelConfig

FUSED_WEIGHT, FUSED_BIAS = "wqkv", "bqkv"
# The projections of one attention layer, in the fused weight's row order.
PARTS, BIASES = ("wq", "wk", "wv", "wg"), ("bq", "bk", "bv")


def fuse_attention_projections(cfg: ModelConfig, weights: dict) -> None:
    """Adds each plain attention layer's fused projection to `weights` (in place)."""
    for i, layer in enumerate(cfg.layers):
        if layer.attention not in ("full", "sliding") or cfg.latent_attention is not None:
            continue
        p = f"layers.{i}."
        names = [p + n for n in PARTS if p + n in weights]
        fused = _concat_rows([weights[n] for n in names])
        if fused is None:
            continue
        weights[p + FUSED_WEIGHT] = fused
        rows = 0
        for name in names:  # each original becomes a view of its rows, freeing its own copy
            n = weights[name].shape[-2]
            weights[name] = _rows(fused, rows, rows + n)
            rows += n
        biases = [p + n for n in BIASES if p + n in weights]
        if biases:
            # One bias slice per fused part, in row order; a part without a bias (the gate; or k
            # where only q and v carry one) adds zeros, so every bias stays beside its own rows.
            slices = [weights.get(p + "b" + name[len(p) + 1 :]) for name in names]
            bias = torch.cat([b if b is not None else weights[biases[0]].new_zeros(weights[n].shape[-2])
                              for b, n in zip(slices, names, strict=True)])
            weights[p + FUSED_BIAS] = bias
            rows = 0
            for name in names:
                n = weights[name].shape[-2]
                bias_name = p + "b" + name[len(p) + 1 :]
                if bias_name in weights:
                    weights[bias_name] = bias[rows : rows + n]
                rows += n


def _concat_rows(parts: list) -> torch.Tensor | QuantizedTensor | None:
    """The parts concatenated along their output rows, or None when they cannot be (mixed kinds,
    dtypes, or quantized layouts off the CPU)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts, dim=-2) if len({p.dtype for p in parts}) == 1 else None
    if not all(isinstance(p, QuantizedTensor) for p in parts):
        return None
    layouts = {(p.bits, p.group, p.codes.dtype, p.scales.dtype, p.zeros is None, p.mins is None, p.dtype)
               for p in parts}
    if len(layouts) > 1:
        # On the CPU every quantized weight is multiplied as its kept dense copy: parts of different
        # layouts (a Q4_K_M file's Q6_K wv beside Q4_K wq) fuse as one dense weight of those very
        # values (one linear a decode step instead of four). None off the CPU or without host room.
        dense = [kept_dense(p) for p in parts]
        return None if any(d is None for d in dense) else torch.cat(dense, dim=-2)
    first = parts[0]

    def cat(field: str) -> torch.Tensor | None:
        return None if getattr(first, field) is None else torch.cat([getattr(p, field) for p in parts], dim=-2)

    shape = (sum(p.shape[-2] for p in parts), first.shape[-1])
    return QuantizedTensor(cat("codes"), cat("scales"), cat("zeros"), first.bits, first.group, shape,
                           first.dtype, cat("mins"))


def _rows(w: torch.Tensor | QuantizedTensor, start: int, end: int) -> torch.Tensor | QuantizedTensor:
    """Rows [start, end) of a 2-D weight, as views."""
    if isinstance(w, torch.Tensor):
        return w[start:end]

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    return QuantizedTensor(w.codes[start:end], w.scales[start:end], part(w.zeros), w.bits, w.group,
                           (end - start, w.shape[-1]), w.dtype, part(w.mins))
