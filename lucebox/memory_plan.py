"""How many bytes a configuration needs, worked out before anything is allocated."""

from __future__ import annotations

import math
import os

import torch

from lucebox.caches import CacheSettings
from lucebox.config import ModelConfig
from lucebox.errors import ContextLengthError
from lucebox.kernels.quant import quantized_bytes
from lucebox.models.layout import quantizable, weight_shapes

HEADROOM = 0.9  # leave a tenth of what is free to the allocator, activations and everyone else


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    return sum(quantized_bytes(shape, quantization) if quantization and quantizable(name)
               else math.prod(shape) * dtype.itemsize for name, shape in weight_shapes(cfg).items())


def plan(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype,
         quantization: str | None = None) -> dict[str, int]:
    """Bytes of weights, ring caches, device KV pool (+ chunk summaries) and the most host KV."""
    size = dtype.itemsize
    row = cfg.kv_bytes_per_token(size)
    full = sum(1 for layer in cfg.layers if not layer.is_sliding)
    weights = weight_bytes(cfg, dtype, quantization)
    rings = sum((layer.window + settings.max_step) * (row + 8) for layer in cfg.layers if layer.is_sliding)
    kvf = settings.kvflash()
    chunks = -(-settings.max_context // kvf.chunk)
    summaries = full * chunks * 3 * cfg.num_kv_heads * cfg.head_dim * size if kvf.policy == "select" else 0
    return {
        "weights": weights,
        "ring_caches": rings,
        "kv_pool_device": full * kvf.pool_chunks * kvf.chunk * row,
        "kv_chunk_summaries_max": summaries,
        "kv_host_max": full * chunks * kvf.chunk * row if kvf.offload else 0,
        "drafter": 0,
    }


def _host_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> dict[str, int]:
    """The plan, or ContextLengthError naming the largest context that fits device + host memory.

    Weights, rings and the pool are fixed costs on the device; host KV and chunk summaries grow
    with max_context (on the CPU, device and host are the same memory)."""
    need = plan(cfg, settings, dtype, quantization)
    fixed = need["weights"] + need["ring_caches"] + need["kv_pool_device"]
    per_token_summary = need["kv_chunk_summaries_max"] / settings.max_context
    per_token_host = need["kv_host_max"] / settings.max_context
    host = HEADROOM * _host_available()
    free = HEADROOM * torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
    if fixed > free:
        raise ContextLengthError(
            f"weights + caches need {fixed / 2**30:.1f} GiB on {device} but about {free / 2**30:.1f} GiB is free; "
            "lower kv_pool_tokens or prefill_chunk, or use a smaller dtype or quantization='int4'"
        )
    if device.type == "cuda":
        budgets = [(free - fixed, per_token_summary), (host, per_token_host)]
    else:
        budgets = [(host - fixed, per_token_summary + per_token_host)]
    if all(spare >= per_token * settings.max_context for spare, per_token in budgets):
        return need
    largest = min(int(max(spare, 0) // per_token) for spare, per_token in budgets if per_token > 0) // 64 * 64
    if largest < 64:
        raise ContextLengthError(
            f"weights and caches ({fixed / 2**30:.1f} GiB) leave no room for offloaded KV on this machine; "
            "lower kv_pool_tokens or prefill_chunk, or use a smaller dtype or quantization='int4'"
        )
    grows = need["kv_host_max"] + need["kv_chunk_summaries_max"]
    raise ContextLengthError(
        f"max_context={settings.max_context} needs {grows / 2**30:.1f} GiB for offloaded KV and its summaries "
        f"on top of {fixed / 2**30:.1f} GiB of weights and caches, more than this machine has free; the largest "
        f"context that fits is about {largest} tokens (pass max_context={largest} or less)"
    )
