"""Each row's argmax over the vocabulary, in one launch after the LM head (the graphed step's
greedy choice; `lucebox.sampling.greedy_choices` is the reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_kernel(logits_ptr, out_ptr, V, stride_row, BLOCK_V: tl.constexpr):
    """Row `program_id`'s first index of its largest logit, or -1 if any of its logits is not
    finite. Blocks are scanned in order and a later block wins only with a strictly larger value,
    so ties go to the lowest index, as torch.argmax's do."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    finite = tl.full((), 1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        # inf - inf is nan and nan != nan: both infinities and nan fail x - x == 0.
        bad = (cols < V) & ((x - x) != 0.0)
        finite = finite & (tl.max(bad.to(tl.int32), axis=0) == 0)
        block_best = tl.max(x, axis=0)
        block_index = v0 + tl.argmax(x, axis=0).to(tl.int64)
        better = block_best > best
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, tl.where(finite != 0, best_index, -1))


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """As `lucebox.sampling.greedy_choices`: logits (T, V) -> (T,) int64."""
    T, V = logits.shape
    out = torch.empty(T, dtype=torch.int64, device=logits.device)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    _greedy_kernel[(T,)](logits, out, V, logits.stride(0), BLOCK_V=min(4096, triton.next_power_of_2(V)))
    return out
