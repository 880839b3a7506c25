"""All the layer caches of one sequence, chosen per layer from the normalized config."""

from __future__ import annotations

import torch

from lucebox.caches.base import KVCache, LayerCache, StateCache
from lucebox.caches.contiguous import ContiguousCache
from lucebox.caches.host_arena import HostArena, aligned
from lucebox.caches.host_chunks import host_chunk_bytes, host_region_bytes
from lucebox.caches.paged import PagedKV
from lucebox.caches.recurrent import RecurrentState
from lucebox.caches.ring import SlidingRing
from lucebox.caches.settings import CacheSettings
from lucebox.config import LayerSpec, ModelConfig


def kv_cache(cfg: ModelConfig, layer: LayerSpec, settings: CacheSettings, dtype: torch.dtype,
             device: torch.device, arena: HostArena | None = None) -> KVCache:
    """An attention layer's cache: the contiguous reference when asked for, a ring for a sliding
    layer (or every layer of a draft model that keeps a window), else the paged pool (its host
    chunks in `arena`)."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    if settings.reference:
        return ContiguousCache(kv, d, settings.max_context, dtype, device)
    if layer.is_sliding or settings.full_attention_window:
        window = layer.window if layer.is_sliding else settings.full_attention_window
        return SlidingRing(window, settings.max_step, kv, d, dtype, device, windowed=layer.is_sliding)
    return PagedKV(settings.kvflash(), kv, d, dtype, device, settings.kv_int8, arena)


def paged_layers(cfg: ModelConfig, settings: CacheSettings) -> int:
    """How many layers `kv_cache` gives a paged pool."""
    if settings.reference or settings.full_attention_window:
        return 0
    return sum(not layer.is_recurrent and not layer.is_sliding for layer in cfg.layers)


def host_kv_bytes(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype) -> int:
    """Host bytes of every paged layer's offloaded K/V (0 when the pools hold the whole context):
    the one arena a `SequenceCache` allocates, which the memory plan counts (`kv_host_max`)."""
    region = host_region_bytes(settings.kvflash(), cfg.num_kv_heads, cfg.head_dim, dtype, settings.kv_int8)
    return paged_layers(cfg, settings) * aligned(region)


def host_staging_bytes(cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype) -> int:
    """The part of `host_kv_bytes` that does not grow with the context: each layer's staging rows
    for a re-selection's loads, and the alignment of its region."""
    kvf = settings.kvflash()
    chunks = -(-kvf.max_context // kvf.chunk) * host_chunk_bytes(kvf, cfg.num_kv_heads, cfg.head_dim, dtype,
                                                                 settings.kv_int8)
    return host_kv_bytes(cfg, settings, dtype) - paged_layers(cfg, settings) * chunks if kvf.offload else 0


class SequenceCache:
    """`length` counts committed positions; layers may hold drafts beyond it until commit/rollback.

    `dirty` is true from a step's first write until its commit completes, and while a commit or
    rollback runs: a step cut short (an exception, Ctrl-C) leaves it true for good, and a dirty
    cache cannot be rewound (`can_rewind_to`), so the engine starts a fresh one instead of reusing
    rows or bookkeeping that may be half written."""

    def __init__(self, cfg: ModelConfig, settings: CacheSettings, dtype: torch.dtype, device: torch.device):
        self.settings = settings
        self.layers: list[LayerCache] = []  # every layer's, in layer order: what their shared contract serves
        # The same caches by kind and layer index: attention reaches a `KVCache`, a recurrent mixer a `StateCache`.
        self.kv: dict[int, KVCache] = {}
        self.states: dict[int, StateCache] = {}
        # Every paged layer's host chunks in one allocation of the planned size (`host_arena`).
        host = host_kv_bytes(cfg, settings, dtype)
        self.host_arena = HostArena(host, pin=device.type == "cuda") if host else None
        for i, layer in enumerate(cfg.layers):
            if layer.is_recurrent:
                cache = self.states[i] = RecurrentState(cfg.linear_attention, settings.decode_rows, dtype, device)
            else:
                cache = self.kv[i] = kv_cache(cfg, layer, settings, dtype, device, self.host_arena)
            self.layers.append(cache)
        self.length = 0
        self._unfinished = 0  # commits and rollbacks begun and not finished: an interrupted one stays counted

    @property
    def dirty(self) -> bool:
        return self._unfinished > 0 or any(layer.dirty for layer in self.layers)

    def commit(self, length: int, choose: bool = True) -> None:
        """Every layer commits; what their commits must read back from the device (KVFlash
        re-selection's rankings, every `kv_reselect_every` tokens) is read in one transfer.
        `choose=False` (a prefill chunk before the prompt's last) leaves a due re-selection due:
        prefill attention is exact, so the choice is made once, at the prompt's last chunk."""
        self._unfinished += 1
        for layer in self.layers:
            layer.begin_commit(length)
        rankings = [layer.ranking(length) if choose else None for layer in self.layers]
        values = self._read_back([r for r in rankings if r is not None])
        for layer, ranking in zip(self.layers, rankings, strict=True):
            layer.finish_commit(length, None if ranking is None else values.pop(0))
        self.length = length
        for layer in self.layers:
            layer.dirty = False  # the step that wrote them is complete
        self._unfinished -= 1

    @staticmethod
    def _read_back(tensors: list[torch.Tensor]) -> list[list]:
        """The tensors' values as flat lists, read in one transfer (none when there are none)."""
        if not tensors:
            return []
        flat = torch.cat([t.flatten() for t in tensors]).tolist()
        parts, start = [], 0
        for t in tensors:
            parts.append(flat[start : start + t.numel()])
            start += t.numel()
        return parts

    def rollback(self, to_position: int) -> None:
        for state in self.states.values():  # a refused rollback changes nothing, not even `dirty`
            state.check_rollback(to_position)
        self._unfinished += 1
        for layer in self.layers:
            layer.rollback(to_position)
        self.length = min(self.length, to_position)
        self._unfinished -= 1

    def accept_path(self, start: int, rows: list[int]) -> None:
        """Every layer moves a verified tree's accepted path into place (`KVCache.accept_path`)."""
        if self.states:  # refused before any layer moves (the engine refuses trees on such models first)
            raise NotImplementedError("recurrent layers cannot verify draft trees: each node would need its state "
                                      "built from its parent's")
        self._unfinished += 1  # an interrupt midway leaves layers that disagree: never reused
        for layer in self.kv.values():
            layer.accept_path(start, rows)
        self._unfinished -= 1

    def can_rewind_to(self, position: int) -> bool:
        """Whether rolling back to `position` keeps every row a later query needs (rings lose rows
        that later writes overwrote; the paged pool and the contiguous cache lose none; a recurrent
        state returns only to a position whose state it kept, or to 0). Never for
        a dirty cache: whatever a cut-short step left half written, a fresh cache is exact."""
        if self.dirty:
            return False
        return all(layer.can_rewind_to(position) for layer in self.layers)

    def rewind_point(self, limit: int) -> int:
        """The longest position <= `limit` that every layer can roll back to exactly: `limit`
        itself, or a state the recurrent layers kept (a pinned snapshot); 0 when there is none."""
        kept = {p for state in self.states.values() for p in state.returnable() if p <= limit}
        return next((p for p in sorted({limit} | kept, reverse=True) if self.can_rewind_to(p)), 0)

    def pin(self, position: int) -> None:
        """Recurrent layers keep their state at `position` (the committed length) across later
        commits, so a later prompt sharing only this prefix can return to it."""
        for state in self.states.values():
            state.pin(position)

    @property
    def has_states(self) -> bool:
        """Whether some layer keeps a recurrent state, which returns only to positions it kept."""
        return bool(self.states)

    def rows_before_reselect(self, position: int) -> int:
        limits = [layer.rows_before_reselect(position) for layer in self.layers]
        return min((limit for limit in limits if limit is not None), default=self.settings.max_step)

    def memory(self) -> dict[str, int]:
        """Bytes of every layer's caches by kind: rings, the paged pool (or contiguous caches) and
        its chunk summaries on the device, KVFlash chunks on the host, recurrent layers' states."""
        total = dict.fromkeys(("ring_caches", "kv_pool_device", "kv_chunk_summaries", "kv_host", "recurrent_states"), 0)
        for layer in self.layers:
            for kind, size in layer.memory().items():
                total[kind] += size
        return total
