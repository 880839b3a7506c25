"""Dtype casts on the hot path."""

from __future__ import annotations

import torch


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; x itself when it already is (a no-op `.to` still costs a dispatch on the CPU)."""
    return x if x.dtype == dtype else x.to(dtype)
