"""How many bytes a configuration needs, worked out before anything is allocated."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lucebox.caches import CacheSettings
from lucebox.caches.recurrent import recurrent_slots
from lucebox.caches.sequence import host_kv_bytes, host_staging_bytes
from lucebox.config import ModelConfig
from lucebox.errors import ContextLengthError, InsufficientMemoryError
from lucebox.kernels.quant import quantized_bytes
from lucebox.limits import DECODE_ROWS, KV_CHUNK
from lucebox.memory.lm_head import head_dense_copy_bytes, head_weight_bytes
from lucebox.models.layout import quantizable, stored_dtype, weight_shapes

HEADROOM = 0.9  # leave a tenth of what is free to the allocator, activations and everyone else


@dataclass(frozen=True)
class DrafterCost:
    """Device bytes a drafter holds once it has drafted: its weights and its caches, which grow by
    `per_ctx_token` bytes with each token of its context ring (`draft_ctx`)."""

    weights: int = 0
    caches: int = 0
    per_ctx_token: int = 0
    draft_ctx: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.caches


class StoredWeights(NamedTuple):
    """Bytes of all weights and of the routed experts among them, as the engine will hold them, and
    of the quantized weights' dense copies the CPU keeps (`dense_copy_bytes`)."""

    total: int
    routed_experts: int
    dense_copies: int = 0


def dense_copy_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Host bytes of the dense copies the CPU keeps of quantized weights (`kernels.quant.kept_dense`:
    each dequantized once, in `dtype`, instead of at every step); none without quantization. At most:
    a copy that would not fit in half of the free host memory is not kept (that weight is then
    dequantized at each step), so these bytes never make a model that fits quantized refuse to load."""
    if not quantization:
        return 0
    return sum(math.prod(shape) * stored_dtype(name, dtype).itemsize
               for name, shape in weight_shapes(cfg).items() if quantizable(name))


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    return sum(quantized_bytes(shape, quantization) if quantization and quantizable(name)
               else math.prod(shape) * stored_dtype(name, dtype).itemsize for name, shape in weight_shapes(cfg).items())


def one_expert_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of one routed expert of one layer (its gate_up and down), as the engine stores it."""
    if cfg.moe is None:
        return 0
    W, H = cfg.moe.expert_size, cfg.hidden_size
    return sum(quantized_bytes(shape, quantization) if quantization else math.prod(shape) * dtype.itemsize
               for shape in ((2 * W, H), (H, W)))


def moe_layer_count(cfg: ModelConfig) -> int:
    return sum(layer.mlp == "moe" for layer in cfg.layers)


def routed_expert_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    """Bytes of every routed expert of every layer: what experts in host memory move off the device."""
    if cfg.moe is None:
        return 0
    return moe_layer_count(cfg) * cfg.moe.num_experts * one_expert_bytes(cfg, dtype, quantization)


def ring_bytes(window: int, max_step: int, row: int) -> int:
    """A `SlidingRing`: `window + max_step` slots of K and V (`row` bytes) and an int64 position."""
    return (window + max_step) * (row + 8)


def cache_ring_bytes(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype) -> int:
    """The rings of a `SequenceCache`: every sliding layer's, and with `full_attention_window`
    (a draft model's cache) every full layer's too."""
    row = cfg.kv_bytes_per_token(dtype.itemsize)
    return sum(ring_bytes(layer.window if layer.is_sliding else settings.full_attention_window, settings.max_step, row)
               for layer in cfg.layers if layer.is_sliding or settings.full_attention_window)


def plan(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype,
         quantization: str | None = None, drafter: DrafterCost = DrafterCost(),
         expert_slots: int | None = None, stored_weights: StoredWeights | None = None,
         lm_head: str | None = None, sequences: int = 1) -> dict[str, int]:
    """Bytes of weights, ring caches, device KV pool (+ chunk summaries), the most host KV, drafter.
    Every cache, and the drafter's (`drafter`'s figures are one sequence's), counts once for each of
    `sequences` run at once (`EngineConfig.parallel`: a slot's cache each).
    With `expert_slots` (experts in host memory) the routed experts count in host memory and the
    device holds that many of each MoE layer's experts (`lucebox.memory.expert_cache`). `stored_weights`:
    the weights' bytes when the checkpoint fixes them (a GGUF file's own quants). `lm_head`: "int8"
    for an int8 output head (`lucebox.memory.lm_head`)."""
    size = dtype.itemsize
    row = cfg.kv_bytes_per_token(size, settings.kv_int8)  # the paged pool's rows
    full = sum(1 for layer in cfg.layers if layer.attention == "full")
    kvf = settings.kvflash()
    chunks = -(-settings.max_context // kvf.chunk)
    summaries = full * chunks * 3 * cfg.num_kv_heads * cfg.head_dim * size if kvf.policy == "select" else 0
    stored = stored_weights or StoredWeights(weight_bytes(cfg, dtype, quantization)
                                             + head_weight_bytes(cfg, dtype, lm_head),
                                             routed_expert_bytes(cfg, dtype, quantization),
                                             dense_copy_bytes(cfg, dtype, quantization)
                                             + head_dense_copy_bytes(cfg, dtype, lm_head))
    weights, experts_host = stored.total, 0
    if expert_slots is not None and cfg.moe is not None:
        experts_host = stored.routed_experts
        weights += expert_slots * experts_host // cfg.moe.num_experts - experts_host
    n = sequences
    return {
        "weights": weights,
        "ring_caches": n * cache_ring_bytes(cfg, settings, dtype),
        "kv_pool_device": n * full * kvf.pool_chunks * kvf.chunk * row,
        "kv_chunk_summaries_max": n * summaries,
        "kv_host_max": n * host_kv_bytes(cfg, settings, dtype),  # each cache's one arena (staging rows included)
        "drafter": drafter.weights + n * drafter.caches,
        "experts_host": experts_host,
        "recurrent_states": n * recurrent_state_bytes(cfg, dtype, settings.decode_rows),
        "dense_copies_cpu_max": stored.dense_copies,  # held only when the weights are on the CPU
    }


def recurrent_state_bytes(cfg: ModelConfig, dtype: torch.dtype, decode_rows: int = DECODE_ROWS) -> int:
    """The states of every recurrent layer (`caches.recurrent.RecurrentState`): the conv state in
    `dtype`, the delta rule's state in float32 at least, in one slot per verify row and one for
    the state a step starts from."""
    if cfg.linear_attention is None:
        return 0
    conv, recurrent = cfg.linear_attention.state_elements()
    per_slot = conv * dtype.itemsize + recurrent * torch.promote_types(dtype, torch.float32).itemsize
    return per_slot * recurrent_slots(decode_rows) * sum(layer.is_recurrent for layer in cfg.layers)


def _host_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, drafter: DrafterCost = DrafterCost(),
               expert_slots: int | None = None, stored_weights: StoredWeights | None = None,
               lm_head: str | None = None, sequences: int = 1) -> dict[str, int]:
    """The plan, or the first thing that does not fit: InsufficientMemoryError for the weights or
    the fixed-size caches (naming the largest `draft_ctx` that fits when the drafter's rings are
    what overflows), ContextLengthError naming the largest context whose offloaded KV fits.

    Weights, rings, the pool and the drafter are fixed costs on the device; host KV and chunk
    summaries grow with max_context (on the CPU, device and host are the same memory)."""
    need = plan(cfg, settings, dtype, quantization, drafter, expert_slots, stored_weights, lm_head, sequences)
    drafter = dataclasses.replace(drafter, caches=sequences * drafter.caches,
                                  per_ctx_token=sequences * drafter.per_ctx_token)
    fixed = need["weights"] + need["ring_caches"] + need["kv_pool_device"] + need["drafter"] + need["recurrent_states"]
    per_token_summary = need["kv_chunk_summaries_max"] / settings.max_context
    staging = sequences * host_staging_bytes(cfg, settings, dtype)  # host KV that does not grow with the context
    per_token_host = (need["kv_host_max"] - staging) / settings.max_context
    host = HEADROOM * _host_available() - need["experts_host"] - staging
    if host < 0:
        raise InsufficientMemoryError(f"the routed experts need {_gib(need['experts_host'])} of host memory "
                                      f"but about {_gib(host + need['experts_host'])} is available")
    free = HEADROOM * torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host
    weights = need["weights"] + drafter.weights
    if weights > free:
        drafter_part = f" ({_gib(drafter.weights)} of them the drafter's)" if drafter.weights else ""
        raise InsufficientMemoryError(
            f"the weights need {_gib(weights)}{drafter_part} on {device} but about {_gib(free)} is free; use a "
            "smaller dtype or quantization='int8' or 'int4'" + (", or a smaller drafter" if drafter.weights else "")
        )
    fewer = f", or run fewer sequences at once than parallel={sequences}" if sequences > 1 else ""
    if fixed > free:
        raise InsufficientMemoryError(_caches_do_not_fit(fixed, free, drafter, device) + fewer)
    if device.type == "cuda":
        budgets = [(free - fixed, per_token_summary), (host, per_token_host)]
    else:
        budgets = [(host - fixed, per_token_summary + per_token_host)]
    if all(spare >= per_token * settings.max_context for spare, per_token in budgets):
        return need
    largest = min(int(max(spare, 0) // per_token) for spare, per_token in budgets if per_token > 0)
    largest = largest // KV_CHUNK * KV_CHUNK
    if largest < KV_CHUNK:
        raise ContextLengthError(
            f"weights and caches ({_gib(fixed)}) leave no room for offloaded KV on this machine; "
            "lower kv_pool_tokens or prefill_chunk, or use a smaller dtype or quantization='int4'" + fewer
        )
    grows = need["kv_host_max"] + need["kv_chunk_summaries_max"]
    raise ContextLengthError(
        f"max_context={settings.max_context} needs {_gib(grows)} for offloaded KV and its summaries "
        f"on top of {_gib(fixed)} of weights and caches, more than this machine has free; the largest "
        f"context that fits is about {largest} tokens (pass max_context={largest} or less{fewer})"
    )


def _caches_do_not_fit(fixed: int, free: float, drafter: DrafterCost, device: torch.device) -> str:
    if drafter.per_ctx_token:
        rings = drafter.per_ctx_token * drafter.draft_ctx
        largest = int((free - (fixed - rings)) // drafter.per_ctx_token)
        largest = largest // KV_CHUNK * KV_CHUNK if largest >= KV_CHUNK else largest
        if largest >= 1:
            return (f"draft_ctx={drafter.draft_ctx}: the drafter's context rings need {_gib(rings)} on top of "
                    f"{_gib(fixed - rings)} of weights and caches, more than the {_gib(free)} free on {device}; "
                    f"the largest draft_ctx that fits is about {largest} (pass draft_ctx={largest} or less)")
    drafter_part = f", {_gib(drafter.caches)} of them the drafter's" if drafter.caches else ""
    return (f"weights + caches need {_gib(fixed)} on {device}{drafter_part} but about {_gib(free)} is free; "
            "lower kv_pool_tokens or prefill_chunk" + (" or draft_ctx" if drafter.per_ctx_token else "")
            + ", or use a smaller dtype or quantization='int4'")
