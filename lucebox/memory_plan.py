"""How many bytes a configuration needs, worked out before anything is allocated."""

from __future__ import annotations

import math
import os

import torch

from lucebox.caches import CacheSettings
from lucebox.config import ModelConfig
from lucebox.errors import ContextLengthError
from lucebox.models.layout import weight_shapes

HEADROOM = 0.9  # leave a tenth of what is free to the allocator, activations and everyone else


def plan(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights, ring caches, device KV pool (+ chunk summaries) and the most host KV."""
    size = dtype.itemsize
    row = cfg.kv_bytes_per_token(size)
    full = sum(1 for layer in cfg.layers if not layer.is_sliding)
    weights = sum(math.prod(shape) for shape in weight_shapes(cfg).values()) * size
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


def check_fits(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """The plan, or ContextLengthError naming the largest context that fits device + host memory."""
    need = plan(cfg, settings, dtype)
    host = HEADROOM * _host_available()
    full = sum(1 for layer in cfg.layers if not layer.is_sliding)
    per_token_host = full * cfg.kv_bytes_per_token(dtype.itemsize)
    on_device = need["weights"] + need["ring_caches"] + need["kv_pool_device"] + need["kv_chunk_summaries_max"]
    if device.type == "cuda":
        free = HEADROOM * torch.cuda.mem_get_info(device)[0]
        if on_device > free:
            raise ContextLengthError(
                f"weights + caches need {on_device / 2**30:.1f} GiB on {device} but {free / 2**30:.1f} GiB is "
                "free; lower kv_pool_tokens or prefill_chunk, or use a smaller dtype or quantized weights"
            )
        spare_host = host
    else:
        spare_host = host - on_device
    if need["kv_host_max"] > spare_host:
        largest = int(max(spare_host, 0) // max(per_token_host, 1)) // 64 * 64
        raise ContextLengthError(
            f"max_context={settings.max_context} needs {need['kv_host_max'] / 2**30:.1f} GiB of host memory for "
            f"offloaded KV but about {max(spare_host, 0) / 2**30:.1f} GiB is available; the largest context that "
            f"fits is about {largest} tokens (pass max_context={largest} or less)"
        )
    return need
