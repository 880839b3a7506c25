"""A smaller model of any supported architecture drafts autoregressively with its own caches.

Its sliding layers keep their rings; its full-attention layers keep a ring of `draft_ctx` slots,
so drafting costs the same at 1K and 256K of context (the drafter forgets the far context, which
can only lower acceptance, never correctness)."""

from __future__ import annotations

import torch

from lucebox.caches import CacheSettings, SequenceCache, Step
from lucebox.limits import DECODE_ROWS, DRAFT_CTX, DRAFT_WIDTH, KV_CHUNK
from lucebox.models.decoder import Decoder
from lucebox.sampling import SamplingParams, add_bias, distribution
from lucebox.speculative.proposer import Draft, Noise, Proposer, chosen_draft, read_drafts, tensor_bytes


def draft_cache_settings(max_context: int, prefill_chunk: int, draft_ctx: int, max_width: int) -> CacheSettings:
    """A draft model's caches: a ring per layer (full layers keep `draft_ctx` tokens), written a
    prefill chunk or one draft round at a time."""
    pool = KV_CHUNK * (-(-max(prefill_chunk, DECODE_ROWS) // KV_CHUNK) + 2)
    return CacheSettings(max_context=max_context, max_step=max(prefill_chunk, max_width + 1), kv_policy="exact",
                         kv_pool_tokens=pool, full_attention_window=draft_ctx)


class DraftModelProposer(Proposer):
    name = "draft model"
    sequential = True  # a forward per draft

    def __init__(self, decoder: Decoder, max_context: int, prefill_chunk: int, draft_ctx: int = DRAFT_CTX,
                 max_width: int = DRAFT_WIDTH):
        self.decoder = decoder
        self.max_width = max_width
        self.prefill_chunk = prefill_chunk
        self.settings = draft_cache_settings(max_context, prefill_chunk, draft_ctx, max_width)
        self.cache: SequenceCache | None = None
        self.cached: list[int] = []  # tokens whose rows the draft cache holds
        self._made_with = (decoder, max_context, prefill_chunk, draft_ctx)

    def fork(self) -> DraftModelProposer:
        return DraftModelProposer(*self._made_with, max_width=self.max_width)

    def device_bytes(self) -> int:
        caches = 0 if self.cache is None else self.cache.memory()["ring_caches"]
        return self.weight_bytes() + caches

    def weight_bytes(self) -> int:
        return tensor_bytes(self.decoder.w.values())

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:
        """Prefill the drafter with the prompt now, beside the target's prefill, rather than in the
        first round: a round then forwards only the few tokens committed since the last one (at most
        a verify step's rows, which read no device value). What its cache shares with the prompt
        is kept, so `resume` need not be told anything: it declines, and this runs every request."""
        self._catch_up(prompt)

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

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Noise,
                own_k: int | None = None) -> Draft:
        """k drafts (`own_k` when given: as deep as the width policy expects to pay, `WidthPolicy.depth`),
        each fed back to the drafter as a device tensor: the host reads the drafts and their
        confidences once, at the end (a read waits for every queued kernel)."""
        k = min(k if own_k is None else own_k, self.max_width)
        if k <= 0:
            return Draft([])
        logits = self._catch_up(context)
        plain = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p)  # no penalty: q is ours
        nothing = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        position = len(self.cached)
        tokens, rows, all_logits = [], [], []
        for i in range(k):
            q = distribution(add_bias(logits, params), plain, nothing).double()  # the target's bias: drafts follow it
            tokens.append(chosen_draft(q, params, generator, len(context) + i))  # (): on the device
            rows.append(q)
            all_logits.append(logits)
            if i + 1 < k:  # the last draft's own logits are never needed
                hidden = self.decoder.forward(tokens[-1].reshape(1), Step.span(position + i, 1, logits.device),
                                              self.cache)
                self.cache.commit(position + i + 1)
                logits = self.decoder.logits(hidden)[0]
        draft = read_drafts(tokens, rows, all_logits, params, generator)
        self.cached += draft.tokens[:-1]
        return draft
