"""Shared helpers of the kernel tests: the device they run on, inputs, tolerances."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter computes bfloat16 wrongly (it stores it as raw 16-bit integers): bf16 on GPUs only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative to the largest value


def random(*shape: int, dtype=torch.float32, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Normal values, never zeros, built on the CPU (reproducible) and moved to the test device."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite values: an output element was never written"
    error = (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)
    assert error <= TOLERANCE[dtype], f"relative error {float(error):.3g} above {TOLERANCE[dtype]:g} for {dtype}"


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, every torch call that makes the host wait for the device (reading a value back,
    data-dependent shapes) raises: what a CUDA graph cannot hold."""
    def refuse(*args, **kwargs):
        raise AssertionError("host sync")

    patched = [(torch.Tensor, name) for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__",
                                                 "cpu", "numpy")]
    patched += [(torch, name) for name in ("nonzero", "unique", "bincount", "masked_select")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
