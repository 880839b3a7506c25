"""How a forward of the engine reaches its keys: the per-layer caches of one `SequenceCache`,
eagerly or inside a CUDA graph (`ForwardContext`, `models/token_mixers.py`)."""

from __future__ import annotations

import torch
from lucebox.kernels.attention import attention_over_blocks
from lucebox.kernels.backend import Kernels

from lucebox.caches import SequenceCache, Step


class CacheContext:
    """An eager forward over a sequence cache: each layer writes its rows into its cache and
    attends over the key blocks the cache hands out (which may stream chunks from the host)."""

    def __init__(self, step: Step, cache: SequenceCache, kernels: Kernels, scale: float):
        self.step, self.cache, self.kernels, self.scale = step, cache, kernels, scale
        self.positions = step.positions

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        layer_cache = self.cache.layers[layer]
        layer_cache.write(self.step, key, value)
        return attention_over_blocks(q, self.positions, layer_cache.blocks(q, self.step), self.scale, window,
                                     self.kernels.attention_partial)


class StaticCacheContext:
    """A graphed decode/verify step, after every layer cache's `reserve`: each layer stores its
    rows at slots the device computes from `positions` and attends over its cache's
    `static_block`, by device work that is the same at every position (`lucebox.engine.runner`)."""

    def __init__(self, positions: torch.Tensor, cache: SequenceCache, kernels: Kernels, scale: float):
        self.positions, self.cache, self.kernels, self.scale = positions, cache, kernels, scale

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        layer_cache = self.cache.layers[layer]
        layer_cache.store(self.positions, key, value)
        block = layer_cache.static_block(q)
        return self.kernels.attention_partial(q, block.k, block.v, self.positions, block.positions, self.scale,
                                              window, block.pinned, block.recent,
                                              k_scale=block.k_scale, v_scale=block.v_scale)[0]
