"""A smaller model of any supported architecture drafts autoregressively with its own caches.

Its sliding layers keep their rings; its full-attention layers keep a ring of `draft_ctx` slots,
so drafting costs the same at 1K and 256K of context (the drafter forgets the far context, which
can only lower acceptance, never correctness)."""

from __future__ import annotations

import torch

from lucebox.caches import CacheSettings, SequenceCache, Step
from lucebox.engine.config import DECODE_ROWS, DRAFT_CTX, DRAFT_WIDTH, KV_CHUNK
from lucebox.models.decoder import Decoder
from lucebox.sampling import SamplingParams, distribution, draw
from lucebox.speculative.proposer import Draft, Proposer, confidence, tensor_bytes


def draft_cache_settings(max_context: int, prefill_chunk: int, draft_ctx: int, max_width: int) -> CacheSettings:
    """A draft model's caches: a ring per layer (full layers keep `draft_ctx` tokens), written a
    prefill chunk or one draft round at a time."""
    pool = KV_CHUNK * (-(-max(prefill_chunk, DECODE_ROWS) // KV_CHUNK) + 2)
    return CacheSettings(max_context=max_context, max_step=max(prefill_chunk, max_width + 1), kv_policy="exact",
                         kv_pool_tokens=pool, full_attention_window=draft_ctx)


class DraftModelProposer(Proposer):
    def __init__(self, decoder: Decoder, max_context: int, prefill_chunk: int, draft_ctx: int = DRAFT_CTX,
                 max_width: int = DRAFT_WIDTH):
        self.decoder = decoder
        self.max_width = max_width
        self.prefill_chunk = prefill_chunk
        self.settings = draft_cache_settings(max_context, prefill_chunk, draft_ctx, max_width)
        self.cache: SequenceCache | None = None
        self.cached: list[int] = []  # tokens whose rows the draft cache holds

    def device_bytes(self) -> int:
        caches = 0 if self.cache is None else self.cache.memory()["ring_caches"]
        return tensor_bytes(self.decoder.w.values()) + caches

    def resume(self, position: int) -> bool:
        return True  # _catch_up keeps whatever prefix of its cache the next context shares

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Make the draft cache hold context[:-1] and forward the rest; logits after context[-1]."""
        shared = 0
        for a, b in zip(self.cached, context[:-1], strict=False):
            if a != b:
                break
            shared += 1
        if self.cache is None or not self.cache.can_rewind_to(shared):
            self.cache = SequenceCache(self.decoder.cfg, self.settings, self.decoder.dtype, self.decoder.device)
            self.cached, shared = [], 0
        self.cache.rollback(shared)
        self.cached = self.cached[:shared]
        ids = torch.tensor(context, device=self.decoder.device)
        for begin in range(shared, len(context), self.prefill_chunk):
            end = min(begin + self.prefill_chunk, len(context))
            hidden = self.decoder.forward(ids[begin:end], Step.span(begin, end - begin, ids.device,
                                                                    prefill=True), self.cache)
            self.cache.commit(end)
        self.cached = list(context)
        return self.decoder.logits(hidden[-1:])[0]

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        k = min(k, self.max_width)
        if k <= 0:
            return Draft([])
        logits = self._catch_up(context)
        plain = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p)  # no penalty: q is ours
        nothing = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        tokens, rows, beliefs = [], [], []
        for i in range(k):
            q = distribution(logits, plain, nothing).double()
            token = int(q.argmax()) if params.greedy else int(draw(q, generator))
            tokens.append(token)
            rows.append(q)
            beliefs += confidence(logits[None], None if params.greedy else q[None])
            if i + 1 < k:  # the last draft's own logits are never needed
                position = len(self.cached)
                hidden = self.decoder.forward(torch.tensor([token], device=logits.device),
                                              Step.span(position, 1, logits.device), self.cache)
                self.cache.commit(position + 1)
                self.cached.append(token)
                logits = self.decoder.logits(hidden)[0]
        return Draft(tokens, None if params.greedy else torch.stack(rows), beliefs)
