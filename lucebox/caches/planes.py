"""The paged pool's storage: the device tensors ("planes") its rows are made of.

In the model dtype a row is one K and one V plane row; with int8 (`kernels.kv_int8`) it is int8
codes of K and V plus a float32 scale per (token, KV head) of each, quantized when stored.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lucebox.kernels.kv_int8 import dequantize_rows, quantize_rows


class KVPlanes:
    """`rows` pool rows of K and V for `kv_heads` heads, head-major.

    Contract: `planes` is (k, v) or, with int8, (k codes, v codes, k scales, v scales), always in
    that order, the same tensors for the pool's life (a CUDA graph holds their addresses): what
    moves to and from the host (`HostChunks` keeps the same order) and what attention reads.
    `store` writes rows at given pool rows and nothing else; `keys` reads keys back in the model
    dtype."""

    def __init__(self, kv_heads: int, rows: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 int8: bool = False):
        self.kv_heads, self.head_dim, self.dtype, self.int8 = kv_heads, head_dim, dtype, int8
        # (KV, rows, D): pool row r of every head.
        self.k = torch.zeros((kv_heads, rows, head_dim), dtype=torch.int8 if int8 else dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # (KV, rows): each row's scale, int8 only.
        self.scales = tuple(torch.zeros(self.k.shape[:2], dtype=torch.float32, device=device)
                            for _ in range(2)) if int8 else ()
        self.planes = (self.k, self.v, *self.scales)

    def store(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """K and V (T, KV, D) at pool `rows` (T,), quantized first with int8."""
        parts = (k, v)
        if self.int8:
            (k_codes, k_scales), (v_codes, v_scales) = quantize_rows(k), quantize_rows(v)
            parts = (k_codes, v_codes, k_scales, v_scales)
        for plane, part in zip(self.planes, parts, strict=True):
            plane.index_copy_(1, rows, part.transpose(0, 1))

    def keys(self, rows: slice) -> torch.Tensor:
        """The keys (KV, n, D) of pool `rows`, in the model dtype."""
        return self._in_model_dtype(self.k[:, rows], self.scales[0][:, rows] if self.int8 else None)

    def fetched_keys(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The keys (KV, n, D), in the model dtype, of planes fetched from the host (`HostChunks.fetch`)."""
        return self._in_model_dtype(parts[0], parts[2] if self.int8 else None)

    def _in_model_dtype(self, keys: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return keys if scales is None else dequantize_rows(keys, scales, self.dtype)

    def nbytes(self) -> int:
        return sum(plane.numel() * plane.element_size() for plane in self.planes)
