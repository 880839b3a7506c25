"""Choosing the device and the dtype from the user's `device=` and `dtype=` arguments, and a clock that
waits for the device."""

from __future__ import annotations

import time

import torch

from lucebox.errors import InvalidArgumentError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise InvalidArgumentError(f"device must be 'auto', 'cpu', 'cuda' or a torch.device, got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise InvalidArgumentError(f"device '{device}' is not a device; use 'auto', 'cpu' or 'cuda'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device '{device}' is not supported; use 'auto', 'cpu' or 'cuda'")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise InvalidArgumentError(f"dtype {dtype} is not supported; use one of {', '.join(sorted(_DTYPES))}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        choices = ", ".join(sorted(_DTYPES))
        raise InvalidArgumentError(f"dtype '{dtype}' is not supported; use 'auto' or one of {choices}")
    return _DTYPES[dtype]


class DeviceClock:
    """Seconds on a wall clock read after the device has finished what was queued, so timings are
    honest on CUDA; `clock(synchronize=False)` reads the host's time alone (no wait), for figures
    nothing decides on."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, synchronize: bool = True) -> float:
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


# Device memory the engine's later kernels take outside the caching allocator: Triton's modules,
# cuBLAS's per-stream workspaces for the capture streams. Not measurable before they load; an allowance.
MODULES_ALLOWANCE = 256 * 2**20


def memory_outside_allocator(device: torch.device) -> int:
    """Bytes of the card that torch's allocator cannot hand out: the CUDA context (created here
    with cuBLAS loaded, as the first matmul would), whatever else holds memory on the card, and
    `MODULES_ALLOWANCE`. A cap on the allocator alone would overcommit a budget equal to the
    card's size by this much."""
    torch.ones((8, 8), device=device) @ torch.ones((8, 8), device=device)  # context + cuBLAS, now
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device)) + MODULES_ALLOWANCE
