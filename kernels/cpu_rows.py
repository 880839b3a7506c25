"""The LM head of a CPU step in oneDNN's packed matmul: the same bits for a row at every row count,
and about a one-row step's cost for a few rows.

torch's float32 `F.linear` on the CPU (MKL) rounds a row otherwise as its step's row count changes:
one row is a matrix-vector product, 2-3 rows take MKL's small-size path, 4 or more its blocked
kernel, each summing the K products in its own order. oneDNN's matmul against a weight reordered
once for it (`torch.ops.mkldnn`, the op torch's own CPU compiler emits for frozen linear layers) runs
one kernel whose order over K follows the packed layout for every row count from 1 up, and reads the
weight once for all rows. For the built-in model's head (4096 x 256, a quarter of its bytes) that
is cheaper than MKL at every width: a verify step's rows cost the head little more than one row,
and a verified row's logits keep the one-row step's bits wherever its hidden state does.

Smaller weights stay with `F.linear`: there oneDNN's op costs about twice MKL's at one row (a
392 x 256 projection: 21 against 9 us), more than plain decoding should pay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.limits import DECODE_ROWS

# The packed copy doubles the head's host memory: a bigger head (a large vocabulary in float32)
# keeps `F.linear` alone.
PACKED_BYTES_MAX = 256 << 20


# oneDNN's packed linear, private by name only (torch's CPU compiler emits them for frozen linears)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
_PACKED_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def onednn_packs() -> bool:
    """Whether this torch build has oneDNN's packed linear (a CPU build with mkldnn)."""
    return torch.backends.mkldnn.is_available() and _REORDER is not None and _PACKED_LINEAR is not None


def _writes(t: torch.Tensor) -> int:
    """How many times `t` was changed in place (torch's version counter). An inference tensor (a
    dense copy of codes made in a step) keeps none: it is made once and never changed."""
    return 0 if t.is_inference() else getattr(t, "_version")  # noqa: B009 (private by name only)


class PackedWeight:
    """A (N, K) weight and its copy reordered for oneDNN's matmul, for steps of at most `DECODE_ROWS`
    rows in float32 on the CPU with nothing to train; any other call (a prefill chunk, gradients,
    another dtype or device) runs `F.linear`. Reordered again if the weight is changed in place."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self._packed: torch.Tensor | None = None
        self._writes = -1

    def usable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (x.device.type == w.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= DECODE_ROWS
                and x.dtype == w.dtype == torch.float32 and not (x.requires_grad or w.requires_grad)
                and w.dim() == 2 and w.numel() * w.element_size() <= PACKED_BYTES_MAX and onednn_packs())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.usable(x):
            return F.linear(x, self.weight)
        if self._packed is None or self._writes != _writes(self.weight):
            # the batch-size hint only picks the layout; a row's bits then follow the layout, not the rows
            self._packed = _REORDER(self.weight.contiguous(), DECODE_ROWS)
            self._writes = _writes(self.weight)
        return _PACKED_LINEAR(x.contiguous(), self._packed, None, "none", [], "")
