"""The speculation stage of a request: rounds of draft, verify, commit.

Contract: `first(logits)` chooses the token after the prompt (from the prefill's last row).
Each `round(cache, tokens, remaining)` drafts d1..dk after the newest token (k = 0 without a
drafter, or when the width policy says drafting does not pay), runs one target step over
[last, d1..dk] through the runner, decides, commits the accepted drafts and the target's next
token to the cache and the drafter, rolls back the rejected rows, and returns the committed
tokens. `tokens` is the list whose rows the cache holds; a round extends it. Host reads of
device values per round: the verdict (one list), plus the drafts when the drafter makes them on
the device (DFlash, a draft model). `stats()` sums the rounds for `Generation.stats`.
"""

from __future__ import annotations

import secrets

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.engine.config import DECODE_ROWS
from lucebox.sampling import SamplingParams
from lucebox.speculative.decide import decide
from lucebox.speculative.proposer import Draft


class Speculation:
    def __init__(self, llm, params: SamplingParams, proposer, prompt_ids: list[int]):
        self.llm, self.params, self.proposer = llm, params, proposer
        device = llm.device
        self.verify_gen = self.draft_gen = None
        if not params.greedy:
            # Unseeded requests draw their seed from the OS, leaving torch's global RNG alone.
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            self.verify_gen = torch.Generator(device=device).manual_seed(seed)
            self.draft_gen = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)  # its own stream
        # Tokens so far, for the repetition penalty (kept up to date only when there is one).
        self.seen = torch.zeros(llm.config.vocab_size, dtype=torch.bool, device=device)
        self.penalized = params.repetition_penalty != 1.0
        self._mark_seen(prompt_ids)
        self.width = llm._width_policy(timed=params.greedy or params.seed is None)
        self.last: int | None = None  # the newest token: chosen, not yet forwarded
        self.totals = {"rounds": 0, "committed": 0, "draft_time_s": 0.0, "verify_time_s": 0.0,
                       **{key: [0] * DECODE_ROWS for key in ("drafted", "accepted", "widths", "kept", "confident")},
                       "confidence": [0.0] * DECODE_ROWS}

    def first(self, logits: torch.Tensor) -> int:
        verdict = decide(logits, Draft([]), self.params, self.seen, self.llm.verify_rule, self.verify_gen)
        self.last = verdict.next_token
        self._mark_seen([self.last])
        return self.last

    def round(self, cache: SequenceCache, tokens: list[int], remaining: int) -> list[int]:
        llm, proposer, width = self.llm, self.proposer, self.width
        c = cache.length
        draft, draft_seconds = Draft([]), 0.0
        limit = min(remaining - 1, cache.rows_before_reselect(c) - 1, llm.cache_settings.max_step - 1,
                    llm.cache_settings.decode_rows - 1, llm.draft_k)
        # Rounds are timed on a synchronized clock only where the adaptive width judges them:
        # on a GPU a synchronize per token would stop the host from queueing ahead.
        timed = proposer is not None and width.speculating and width.timed and llm.adaptive
        if proposer is not None and limit > 0 and width.speculating:
            t0 = llm._clock(timed)
            draft = proposer.propose(tokens + [self.last], min(limit, proposer.max_width), self.params,
                                     self.draft_gen)
            available = len(draft.tokens)
            k = width.choose(draft.confidence, available, limit) if llm.adaptive else min(available, limit)
            draft = Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k], draft.confidence[:k])
            draft_seconds = llm._clock(timed) - t0
        t1 = llm._clock(timed)
        rows = [self.last, *draft.tokens]
        out = llm.runner.step(rows, Step.span(c, len(rows), llm.device), cache,
                              proposer.feature_layers if proposer else ())
        # The step's own argmax (computed with it, in its graph) serves greedy decoding unless a
        # repetition penalty changes the logits first.
        choices = None if self.penalized else out.choices
        verdict = decide(out.logits, draft, self.params, self.seen, llm.verify_rule, self.verify_gen, choices)
        n = verdict.accepted
        cache.commit(c + n + 1)
        if n < len(draft.tokens):
            cache.rollback(c + n + 1)  # rejected drafts' rows leave every cache
        tokens.extend(rows[: n + 1])
        if proposer is not None:
            proposer.commit(tokens, n + 1, None if out.features is None else out.features[: n + 1])
        verify_seconds = llm._clock(timed) - t1
        self._record(draft, n, draft_seconds, verify_seconds)
        committed = [*draft.tokens[:n], verdict.next_token]
        self.last = verdict.next_token
        self._mark_seen(committed)
        return committed

    def _mark_seen(self, ids: list[int]) -> None:
        if self.penalized:  # without a penalty nothing reads it
            self.seen[torch.tensor(ids, device=self.seen.device)] = True

    def _record(self, draft: Draft, n: int, draft_s: float, verify_s: float) -> None:
        spec, k = self.totals, len(draft.tokens)
        for i, c in enumerate(draft.confidence):
            spec["confidence"][i] += c
            spec["confident"][i] += 1
        spec["rounds"] += 1
        spec["committed"] += n + 1
        spec["draft_time_s"] += draft_s
        spec["verify_time_s"] += verify_s
        spec["widths"][k] += 1
        spec["kept"][n] += 1
        for i in range(k):
            spec["drafted"][i] += 1
            spec["accepted"][i] += int(i < n)
        self.width.record(n + 1, draft_s + verify_s, verify_s, k + 1, proposed=draft_s > 0,
                          confidence=draft.confidence)

    def stats(self) -> dict:
        spec = self.totals
        positions = [a / d for a, d in zip(spec["accepted"], spec["drafted"], strict=True) if d]
        return {
            "rounds": spec["rounds"],
            # Mean tokens committed per verify round (1.0 without drafts).
            "acceptance_length": spec["committed"] / spec["rounds"] if spec["rounds"] else 0.0,
            "acceptance_by_position": positions,  # share of drafted i-th positions that were kept
            # The drafter's mean confidence in its i-th drafts (its own probability of the token, when it
            # reports one), beside acceptance_by_position: how well confidence predicts acceptance.
            "confidence_by_position": [c / n for c, n in zip(spec["confidence"], spec["confident"], strict=True) if n],
            "draft_time_s": spec["draft_time_s"],
            "verify_time_s": spec["verify_time_s"],
            "width_histogram": {k: c for k, c in enumerate(spec["widths"]) if c},  # drafts verified -> rounds
            "accepted_histogram": {n: c for n, c in enumerate(spec["kept"]) if c},  # drafts kept -> rounds
        }
