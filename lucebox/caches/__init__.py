"""KV caches: a sliding ring per sliding layer, a paged pool with KVFlash host offload per full
layer, and the plain contiguous cache they are tested against."""

from lucebox.caches.base import KVBlock, LayerCache, Step
from lucebox.caches.paged import PagedKV
from lucebox.caches.ring import SlidingRing
from lucebox.caches.sequence import SequenceCache
from lucebox.caches.settings import KV_POLICIES, CacheSettings, KVFlashSettings

__all__ = ["KV_POLICIES", "CacheSettings", "KVBlock", "KVFlashSettings", "LayerCache", "PagedKV",
           "SequenceCache", "SlidingRing", "Step"]
