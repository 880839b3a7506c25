"""Layer caches of two kinds (`KVCache`, `StateCache`) under one contract (`LayerCache`): a sliding
ring per sliding layer, a paged pool with KVFlash host offload per full layer, the plain contiguous
cache they are tested against, and a recurrent layer's state."""

from lucebox.caches.base import KVBlock, KVCache, LayerCache, StateCache, Step
from lucebox.caches.paged import PagedKV
from lucebox.caches.ring import SlidingRing
from lucebox.caches.sequence import SequenceCache
from lucebox.caches.settings import KV_POLICIES, CacheSettings, KVFlashSettings

__all__ = ["KV_POLICIES", "CacheSettings", "KVBlock", "KVCache", "KVFlashSettings", "LayerCache", "PagedKV",
           "SequenceCache", "SlidingRing", "StateCache", "Step"]
