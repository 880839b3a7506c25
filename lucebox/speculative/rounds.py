"""The speculation stage of a request: rounds of draft, verify, commit.

Contract: the stage works only with what its `DecodeContext` hands it (runner, cache, clock,
verify-cost table, limits, rules) and owns `tokens`, the ids whose rows the cache holds (the
prompt, then every committed token). `first(logits)` chooses the token after the prompt (from
the prefill's last row). Each `round(remaining, take)` drafts d1..dk after the newest token (k = 0
without a drafter, or when the width policy says drafting does not pay), runs one target step
over [last, d1..dk] through the runner, decides, and offers the new tokens to `take` (the text
stage), which returns the chunk of those it accepts: all of them, or the ones up to a stop. Only
the accepted tokens are committed, to the cache and the drafter; every other row is rolled back.
So nothing past a stop is ever committed. Host reads of device values per round: the verdict
(one list), plus the drafts when the drafter makes them on the device (DFlash, a draft model).
`stats()` sums the rounds for `Generation.stats`.

Under a grammar (`constrained.GrammarState`) a round verifies only the drafts up to the first one
the grammar forbids, decides on the logits masked row by row, and the grammar commits with the
cache; rounds are chains (a tree's rows would each need their own mask). A speculating round
whose next bytes the grammar forces drafts the tokens that write them (`GrammarState.forced`).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.device import DeviceClock
from lucebox.engine.config import DECODE_ROWS
from lucebox.generation import Chunk
from lucebox.logprobs import token_logprobs
from lucebox.sampling import RaceNoise, SamplingParams
from lucebox.speculative.decide import decide
from lucebox.speculative.keep_model import DraftJudge, KeepModel
from lucebox.speculative.learned import Learned
from lucebox.speculative.proposer import Draft, Proposer
from lucebox.speculative.tree_round import tree_round
from lucebox.speculative.width import ProbeSchedule, WidthPolicy, fixed_costs


@dataclass(frozen=True)
class DecodeContext:
    """What one request's speculation stage works with, handed to it by the engine."""

    runner: object  # `engine.runner.StepRunner`: one target step of any width
    cache: SequenceCache
    clock: DeviceClock
    learned: Learned | None  # costs and keep rates the engine's requests share; None: fixed width
    draft_k: int  # most drafts one round verifies
    verify_rule: str  # "coupled" | "tokenwise" | "block", for sampled rounds
    adaptive: bool  # choose each round's width by cost (else always the most the limits allow)
    vocab_size: int
    device: torch.device
    tree_budget: int = 0  # draft rows of a tree round (DFlash drafters); 0: chains


class Speculation:
    def __init__(self, context: DecodeContext, params: SamplingParams, proposer: Proposer | None,
                 prompt_ids: list[int], grammar=None, logprobs: int | None = None):
        self.context, self.params, self.proposer = context, params, proposer
        self.grammar = grammar  # a `constrained.GrammarState`, or None
        self.top_logprobs = logprobs  # None: no logprobs; k: each token's and the k likeliest
        self.tokens = list(prompt_ids)  # the ids whose rows the cache holds, in order
        device = context.device
        self.verify_gen = self.draft_gen = None
        if not params.greedy:
            # Unseeded requests draw their seed from the OS, leaving torch's global RNG alone.
            seed = params.seed if params.seed is not None else secrets.randbits(62)
            if context.verify_rule == "coupled":  # target and drafter race against the same noise
                self.verify_gen = self.draft_gen = RaceNoise(seed)
            else:
                self.verify_gen = torch.Generator(device=device).manual_seed(seed)
                self.draft_gen = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)  # its own stream
        # Tokens so far, for the repetition penalty, and how often each was generated, for the presence
        # and frequency penalties (each kept up to date only when its penalty is on).
        self.seen = torch.zeros(context.vocab_size, dtype=torch.bool, device=device)
        self.counts = (torch.zeros(context.vocab_size, dtype=torch.float32, device=device)
                       if params.counts_generated else None)
        self.penalized = params.penalized
        self._mark_seen(prompt_ids, generated=False)
        self.width = _policy(context, params, proposer is not None)
        self.judge = DraftJudge(self.width.keep)
        # Prompt-lookup copies have keep rates of their own (repeating text is kept far more often than a
        # drafted block, and under sampling far less than when greedy), learned by their own judge.
        self.copy_width = _policy(context, params, proposer is not None, copies=True)
        self.copy_judge = DraftJudge(self.copy_width.keep)
        self.last: int | None = None  # the newest token: chosen, not yet forwarded
        self.totals = RoundTotals()
        # Trees from drafters that make them (DFlash). Sampled rounds of the other rules keep chains
        # unless the width is fixed: a tree keeps only exact matches of the target's sample, a chain
        # keeps min(1, p/q) of each draft, which under those rules keeps more. Coupled trees hold the
        # likeliest winners of the very race the target runs.
        self.trees = (context.tree_budget > 0 and proposer is not None and proposer.drafts_trees and grammar is None
                      and (params.greedy or context.verify_rule == "coupled" or not context.adaptive))
        # Adaptive timed rounds choose chain or tree by the rates each delivered; else always the tree.
        timed = self.width.adaptive and self.width.timed and context.learned is not None
        mode = "greedy" if params.greedy else "sampled"
        self.shapes = context.learned.shapes[mode] if self.trees and timed else None

    def first(self, logits: torch.Tensor) -> int:
        if self.grammar is not None:
            logits, _ = self.grammar.constrain(logits, Draft([]))
        verdict = decide(logits, Draft([]), self.params, self.seen, self.context.verify_rule, self.verify_gen,
                         position=len(self.tokens), counts=self.counts)
        self.last = verdict.next_token
        if self.grammar is not None:
            self.grammar.commit([self.last])
        self._mark_seen([self.last])
        return self.last

    def round(self, remaining: int, take: Callable[[list[int]], Chunk]) -> Chunk:
        """One round; `remaining`: tokens the request may still produce."""
        if self.trees and (self.shapes is None or self.shapes.choose() == "tree"):
            return tree_round(self, remaining, take)
        ctx, cache, width = self.context, self.context.cache, self.width
        c = cache.length
        limit = self.draft_limit(remaining)
        # Rounds are timed (a synchronized clock) only where the policy learns from the times; the
        # wait is short, since every round reads its verdict (and its drafts) on the host anyway.
        timed = width.has_drafter and width.timed and width.adaptive
        t0 = ctx.clock(timed)
        context = self.tokens + [self.last] if self.proposer is not None else []  # once a round: it is long
        forced = self.grammar.forced(limit) if self.grammar is not None and self.proposer is not None else []
        if forced:  # what the grammar forces (a JSON key, punctuation) is drafted instead of the drafter's guess
            self.to_judge([], [], [])
            draft = Draft(forced, copied=True)
        else:
            draft = self._draft(limit, context) if self._drafting(limit, context) else None
        t1 = ctx.clock(timed)
        verified = Draft([]) if draft is None else draft
        if self.grammar is not None:
            verified = self.grammar.cut(verified)
        rows = [self.last, *verified.tokens]
        layers = self.proposer.feature_layers if self.proposer is not None else ()
        out = ctx.runner.step(rows, Step.span(c, len(rows), ctx.device), cache, layers)
        # The step's own argmax (computed with it, in its graph) serves greedy decoding unless a
        # penalty or the logit bias changes the logits first.
        choices, logits = None if self.penalized else out.choices, out.logits
        if self.grammar is not None:  # the step's own argmax is the unmasked one
            (logits, verified), choices = self.grammar.constrain(logits, verified), None
        verdict = decide(logits, verified, self.params, self.seen, ctx.verify_rule, self.verify_gen, choices,
                         position=c + 1, counts=self.counts)
        n = verdict.accepted
        chunk = self.attach_logprobs(take([*verified.tokens[:n], verdict.next_token]), out.logits)
        kept = len(chunk.token_ids)  # n + 1, or fewer when a stop ends the request inside the round
        if self.grammar is not None:
            self.grammar.commit(chunk.token_ids)
        self._commit(rows[:kept], len(rows), None if out.features is None else out.features[:kept])
        t2 = ctx.clock(timed)
        self.judged(chunk.token_ids)
        self.totals.add(verified, n, t1 - t0 if draft is not None else 0.0, t2 - t1)
        # A copy's lookup is not the drafter's pass: its time would price the drafter at next to nothing.
        width.record(len(rows), t2 - t1, None if draft is None or draft.copied else t1 - t0)
        if self.shapes is not None and draft is not None and not draft.copied:  # copies: the same either shape
            self.shapes.record("chain", len(chunk.token_ids), t2 - t0)
        self.last = chunk.token_ids[-1]
        self._mark_seen(chunk.token_ids)
        return chunk

    def draft_limit(self, remaining: int) -> int:
        """The most drafts (or draft rows of a tree) this round may verify."""
        cache = self.context.cache
        return min(remaining - 1, cache.rows_before_reselect(cache.length) - 1, cache.settings.max_step - 1,
                   cache.settings.decode_rows - 1, self.context.draft_k)

    def _drafting(self, limit: int, context: list[int]) -> bool:
        """Whether this round drafts: always when the proposer has a copy of earlier text to offer
        (it costs next to nothing; the copies' keep rates cut it), else as the width policy expects
        the drafter to pay."""
        if limit > 0 and self.proposer is not None and self.proposer.copies(context):
            return True
        return self.width.should_draft(limit)

    def _draft(self, limit: int, context: list[int]) -> Draft:
        """Up to `limit` drafts after `last`, cut to the width the policy chooses; the whole block
        goes to the judge, which learns from every draft whether verified or not."""
        proposer, most = self.proposer, min(limit, self.proposer.max_width)
        draft = proposer.propose(context, most, self.params, self.draft_gen)
        copy: list[int] = []
        if draft.copied:
            kept = self.cut_copy(draft.tokens, limit)
            if kept or not self.width.should_draft(limit):
                return Draft(kept, copied=True)
            # No copied token pays, the drafter's drafts may (or their probe is due): they are drafted
            # instead, so text that offers copies at every round still drafts, measures and probes.
            copy, draft = draft.tokens, proposer.own_draft(context, most, self.params, self.draft_gen)
        self.to_judge(draft.tokens, draft.confidence, copy)
        k = self.width.choose(draft.confidence, len(draft.tokens), limit)
        return Draft(draft.tokens[:k], None if draft.q is None else draft.q[:k], draft.confidence[:k])

    def cut_copy(self, copied: list[int], limit: int) -> list[int]:
        """A copy's first tokens, as many as the copies' keep rates pay to verify (none: a plain round);
        the whole copy is judged by what gets committed, so a cut copy still teaches."""
        self.to_judge([], [], copied)
        return copied[: self.copy_width.choose(None, len(copied), limit)]

    def to_judge(self, drafted: list[int], confidence: list[float], copied: list[int]) -> None:
        """The newest block, the drafter's or a copy, replaces whatever an older one still predicted."""
        self.judge.drafted(drafted, confidence)
        self.copy_judge.drafted(copied, [])

    def judged(self, committed: list[int]) -> None:
        """Tokens just committed judge the pending drafts, the drafter's and a copy's."""
        self.judge.committed(committed)
        self.copy_judge.committed(committed)

    def _commit(self, kept_rows: list[int], written: int, features: torch.Tensor | None) -> None:
        """The kept rows ([last, d1..]) into the cache and the drafter; the rest of the `written` rolled back."""
        cache = self.context.cache
        end = cache.length + len(kept_rows)
        cache.commit(end)
        if len(kept_rows) < written:
            cache.rollback(end)  # rejected drafts' rows (and any past a stop) leave every cache
        self.tokens.extend(kept_rows)
        if self.proposer is not None:
            self.proposer.commit(self.tokens, len(kept_rows), features)

    def attach_logprobs(self, chunk: Chunk, logits: torch.Tensor, rows: list[int] | None = None) -> Chunk:
        """`chunk` with its tokens' logprobs when the request asked for them: token i was chosen by
        row i of `logits` (T, V) (or by row rows[i]), the target's raw logits (`lucebox.logprobs`)."""
        if self.top_logprobs is not None and chunk.token_ids:
            chunk.logprobs = token_logprobs(logits if rows is None else logits[rows], chunk.token_ids,
                                            self.top_logprobs)
        return chunk

    def _mark_seen(self, ids: list[int], generated: bool = True) -> None:
        if not self.params.reads_history:  # without a penalty that reads them, nothing does
            return
        index = torch.tensor(ids, dtype=torch.long, device=self.seen.device)
        self.seen[index] = True
        if generated and self.counts is not None:
            self.counts.index_put_((index,), torch.ones(len(ids), device=self.counts.device), accumulate=True)

    def stats(self) -> dict:
        return {**self.totals.as_stats(), **({} if self.grammar is None else self.grammar.stats())}


def _policy(context: DecodeContext, params: SamplingParams, has_drafter: bool, copies: bool = False) -> WidthPolicy:
    """Adaptive with the engine's shared costs, keep rates (of the drafter, or of prompt-lookup
    `copies`) and the drafter's probe schedule of this mode; fixed without them (copies then
    verified whole). A seeded sampled
    request verified by drawn outcomes (tokenwise, block) decides without clocks from a fresh copy
    of the calibration, since its tokens depend on the widths it used; coupled rounds commit the
    same tokens whatever the widths, so their seeded requests use the clock too."""
    learned = context.learned
    if learned is None or not context.adaptive:
        return WidthPolicy(fixed_costs(), KeepModel(), adaptive=False, has_drafter=has_drafter)
    reproducible = not params.greedy and params.seed is not None and context.verify_rule != "coupled"
    if reproducible:
        return WidthPolicy(fixed_costs(), learned.keep_for(params, True, copies), timed=False, has_drafter=has_drafter)
    probes = ProbeSchedule() if copies else learned.probes["greedy" if params.greedy else "sampled"]
    return WidthPolicy(learned.costs, learned.keep_for(params, False, copies), has_drafter=has_drafter, probes=probes)


class RoundTotals:
    """The rounds of one request summed: what `Generation.stats` reports about speculation."""

    def __init__(self):
        self.rounds, self.committed = 0, 0
        self.draft_time_s = self.verify_time_s = 0.0
        # per draft position (or per width / kept count), DECODE_ROWS of each
        self.drafted, self.accepted, self.widths, self.kept, self.confident = ([0] * DECODE_ROWS for _ in range(5))
        self.confidence = [0.0] * DECODE_ROWS

    def add(self, draft: Draft, n: int, draft_s: float, verify_s: float, width: int | None = None) -> None:
        """A round that verified `draft` and accepted its first `n` drafts (`width`: the draft rows
        verified, when a tree's are more than its deepest path)."""
        k = len(draft.tokens)
        for i, c in enumerate(draft.confidence):
            self.confidence[i] += c
            self.confident[i] += 1
        self.rounds += 1
        self.committed += n + 1
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        self.widths[k if width is None else width] += 1
        self.kept[n] += 1
        for i in range(k):
            self.drafted[i] += 1
            self.accepted[i] += int(i < n)

    def as_stats(self) -> dict:
        positions = [a / d for a, d in zip(self.accepted, self.drafted, strict=True) if d]
        return {
            "rounds": self.rounds,
            # Mean tokens committed per verify round (1.0 without drafts).
            "acceptance_length": self.committed / self.rounds if self.rounds else 0.0,
            "acceptance_by_position": positions,  # share of drafted i-th positions that were kept
            # The drafter's mean confidence in its i-th drafts (its own probability of the token, when it
            # reports one), beside acceptance_by_position: how well confidence predicts acceptance.
            "confidence_by_position": [c / n for c, n in zip(self.confidence, self.confident, strict=True) if n],
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "width_histogram": {k: c for k, c in enumerate(self.widths) if c},  # drafts verified -> rounds
            "accepted_histogram": {n: c for n, c in enumerate(self.kept) if c},  # drafts kept -> rounds
        }
