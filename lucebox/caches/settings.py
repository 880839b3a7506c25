"""What the caches of one sequence are built from: `CacheSettings` (the engine's choices) and
`KVFlashSettings` (one full-attention layer's paged pool, derived from them).

Defaults that are the engine's (pool size, reselect interval, `select` tail, step rows, chunk size)
are imported from `lucebox.engine.config`, where the CLI, the planner and `LLM` read them too;
only choices internal to the pool are defined here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.errors import InvalidArgumentError
from lucebox.limits import (
    DECODE_ROWS,
    KV_CHUNK,
    KV_POLICIES,
    KV_POOL_TOKENS,
    KV_RESELECT_EVERY,
    SELECT_TAIL_TOKENS,
)

# `exact` streams host chunks to attention in runs of this many (a prefill's; a decode step takes
# longer ones, `paged_blocks.DECODE_RUN_MULTIPLE`): a cache-internal trade between the number of
# blocks merged and the device memory one run of fetched chunks takes.
STREAM_CHUNKS = 64


@dataclass(frozen=True)
class KVFlashSettings:
    policy: str
    pool_tokens: int
    max_context: int
    max_step: int  # most rows one forward writes (prefill chunk or verify width)
    decode_rows: int = DECODE_ROWS
    chunk: int = KV_CHUNK
    tail_tokens: int = SELECT_TAIL_TOKENS
    reselect_every: int = KV_RESELECT_EVERY
    stream_chunks: int = STREAM_CHUNKS

    @property
    def pool_chunks(self) -> int:
        return self.pool_tokens // self.chunk

    @property
    def offload(self) -> bool:
        return self.max_context > self.pool_chunks * self.chunk

    @property
    def tail_span(self) -> int:
        """Most chunks the tail of one decode/verify step can touch."""
        return -(-(self.tail_tokens + self.decode_rows) // self.chunk) + 1

    @property
    def select_k(self) -> int:
        """Chunks chosen by score: what the pool holds beyond sink, tail and one spare slot."""
        return self.pool_chunks - 1 - self.tail_span - 1

    @property
    def min_pool_chunks(self) -> int:
        """The smallest pool this policy and step size can run with: the sink, the chunks one step
        writes and a spare (and for `select`, the tail)."""
        return max(-(-self.max_step // self.chunk) + 2, self.tail_span + 2 if self.policy == "select" else 0)

    def tail_start(self, position: int) -> int:
        """The first chunk of the `select` tail of a query at `position`."""
        return max(0, (position - self.tail_tokens) // self.chunk)

    def validate(self) -> None:
        if self.policy not in KV_POLICIES:
            raise InvalidArgumentError(f"kv_policy '{self.policy}' is not one of {', '.join(KV_POLICIES)}")
        need = self.min_pool_chunks
        if self.pool_chunks < need:
            raise InvalidArgumentError(
                f"kv_pool_tokens={self.pool_tokens} is too small: this configuration needs at least "
                f"{need * self.chunk} tokens (sink + the rows one step writes, prefill_chunk={self.max_step}"
                f"{', + the select tail' if self.policy == 'select' else ''}); "
                "raise kv_pool_tokens or lower prefill_chunk"
            )
        if self.tail_tokens < 2 * self.reselect_every:
            raise InvalidArgumentError("tail_tokens must be at least twice kv_reselect_every")


@dataclass(frozen=True)
class CacheSettings:
    max_context: int
    max_step: int  # most rows one forward writes: max(prefill_chunk, verify width)
    kv_policy: str
    kv_pool_tokens: int
    kv_reselect_every: int = KV_RESELECT_EVERY
    decode_rows: int = DECODE_ROWS
    reference: bool = False  # contiguous caches for every layer: the plain reference, for tests
    full_attention_window: int | None = None  # draft models: full layers keep only a ring this long
    kv_int8: bool = False  # the paged pool and host chunks hold int8 rows (`kernels.kv_int8`)

    @classmethod
    def for_engine(cls, max_context: int, prefill_chunk: int, kv_policy: str | None = None,
                   kv_pool_tokens: int | None = None, kv_reselect_every: int = KV_RESELECT_EVERY,
                   kv_int8: bool = False) -> CacheSettings:
        """The engine's settings, defaults filled in: a pool holding the whole context up to
        KV_POOL_TOKENS (at least what one prefill chunk needs), and `exact` attention when the
        pool holds the whole context, `select` when it cannot."""
        rounded = -(-max_context // KV_CHUNK) * KV_CHUNK
        minimum = (-(-prefill_chunk // KV_CHUNK) + 2) * KV_CHUNK
        pool = kv_pool_tokens if kv_pool_tokens is not None else max(min(KV_POOL_TOKENS, rounded), minimum)
        policy = kv_policy or ("exact" if rounded <= pool else "select")
        return cls(max_context, max(prefill_chunk, DECODE_ROWS), policy, pool, kv_reselect_every, kv_int8=kv_int8)

    def kvflash(self) -> KVFlashSettings:
        # The tail is at least two reselect intervals long, as `KVFlashSettings.validate` demands.
        return KVFlashSettings(self.kv_policy, self.kv_pool_tokens, self.max_context, self.max_step,
                               decode_rows=self.decode_rows, reselect_every=self.kv_reselect_every,
                               tail_tokens=max(SELECT_TAIL_TOKENS, 2 * self.kv_reselect_every))
