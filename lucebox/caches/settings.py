"""The settings of one full-attention layer's paged pool (`KVFlashSettings`) and its policies."""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.engine.config import DECODE_ROWS, KV_CHUNK
from lucebox.errors import InvalidArgumentError

KV_POLICIES = ("exact", "select")


@dataclass(frozen=True)
class KVFlashSettings:
    policy: str
    pool_tokens: int
    max_context: int
    max_step: int  # most rows one forward writes (prefill chunk or verify width)
    decode_rows: int = DECODE_ROWS
    chunk: int = KV_CHUNK
    tail_tokens: int = 256
    reselect_every: int = 64
    stream_chunks: int = 64

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
