"""One speculation round over a chain of drafts: d1..dk after `last` (k = 0 without a drafter, or
when the width policy says drafting does not pay), one target step over [last, d1..dk], the
decision (`decide`), and the new tokens offered to the text stage. It returns its verdict
(`round_result.RoundResult`); `rounds.Speculation.apply` commits it.

Under a grammar the round verifies only the drafts up to the first one the grammar forbids and
decides on the logits masked row by row; where the grammar forces the next bytes, the tokens that
write them are the drafts (`GrammarState.forced`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lucebox.caches import Step
from lucebox.generation import Chunk
from lucebox.speculative.decide import decide
from lucebox.speculative.proposer import Draft
from lucebox.speculative.round_result import RoundResult

if TYPE_CHECKING:
    from lucebox.speculative.rounds import Speculation


class ChainRound:
    def __init__(self, spec: Speculation):
        self.spec = spec
        self.made = 0

    def run(self, remaining: int, take: Callable[[list[int]], Chunk]) -> RoundResult:
        """One round; `remaining`: tokens the request may still produce."""
        spec = self.spec
        ctx, state, grammar = spec.context, spec.state, spec.grammar
        c = ctx.cache.length
        limit, allotted = spec.draft_limit(remaining), spec.draft_limit(remaining, allotted=True)
        began = ctx.clock(spec.timed)
        self.made = 0  # drafts the drafter makes this round (`_draft`)
        draft = self._drafts(limit, allotted)
        stepped = ctx.clock(spec.timed)
        verified = Draft([]) if draft is None else draft
        if grammar is not None:
            verified = grammar.cut(verified)
        rows = [state.last, *verified.tokens]
        layers = spec.proposer.feature_layers if spec.proposer is not None else ()
        # In a batched step (where more than a share is allotted) the drafter's own drafts go with
        # their chances of being kept: the runner keeps the likeliest of every request's.
        cuttable = allotted > limit and verified.tokens and not verified.copied
        out = ctx.runner.step(rows, Step.span(c, len(rows), ctx.device), ctx.cache, layers,
                              **({"reach": spec.reach(verified)} if cuttable else {}))
        if len(out.logits) < len(rows):  # the batch kept fewer of the drafts: the step was theirs alone
            rows, verified = rows[: len(out.logits)], verified.first(len(out.logits) - 1)
        # The step's own argmax (computed with it, in its graph) serves greedy decoding unless a
        # penalty or the logit bias changes the logits first.
        choices, logits = None if spec.penalized else out.choices, out.logits
        if grammar is not None:  # the step's own argmax is the unmasked one
            (logits, verified), choices = grammar.constrain(logits, verified), None
        verdict = decide(logits, verified, spec.params, state.seen, ctx.verify_rule, spec.verify_gen, choices,
                         position=c + 1, counts=state.counts)
        n = verdict.accepted
        chunk = spec.attach_logprobs(take([*verified.tokens[:n], verdict.next_token]), out.logits)
        kept = len(chunk.token_ids)  # n + 1, or fewer when a stop ends the request inside the round
        return RoundResult(chunk=chunk, rows=rows[:kept], written=len(rows), path=None,
                           features=None if out.features is None else out.features[:kept], accepted=n,
                           depth=len(verified.tokens), confidence=verified.confidence, shape="chain",
                           drafted=draft is not None, own_drafts=draft is not None and not draft.copied,
                           began=began, stepped=stepped, forward_rows=out.forward_rows,
                           waited_s=out.waited_s, drafts_made=self.made)

    def _drafts(self, limit: int, allotted: int) -> Draft | None:
        """This round's drafts, or None for a plain round: a copy's or the grammar's up to `limit`,
        the drafter's up to `allotted` (`Speculation.draft_limit`)."""
        spec = self.spec
        context = spec.state.tokens + [spec.state.last] if spec.proposer is not None else []  # once a round: it is long
        forced = spec.grammar.forced(limit) if spec.grammar is not None and spec.proposer is not None else []
        if forced:  # what the grammar forces (a JSON key, punctuation) is drafted instead of the drafter's guess
            spec.to_judge([], [], [])
            return Draft(forced, copied=True)
        # whether to draft is judged at the share: a wider round than the batch will likely run would
        # price drafting too well
        return self._draft(limit, allotted, context) if spec.drafting(limit, context) else None

    def _draft(self, limit: int, allotted: int, context: list[int]) -> Draft:
        """Up to `allotted` drafts after `last` (a copy's: `limit`), cut to the width the policy
        chooses; the whole block goes to the judge, which learns from every draft whether verified or not."""
        spec = self.spec
        proposer, most = spec.proposer, min(allotted, spec.proposer.max_width)
        # A sequential drafter makes a pass per draft: its own drafts go as deep as the policy expects
        # to pay, while a copy (next to free) may be as long as any
        own = spec.width.depth(most) if proposer.sequential else most
        draft = proposer.propose(context, most, spec.params, spec.draft_gen, **({"own_k": own} if own < most else {}))
        copy: list[int] = []
        if draft.copied:
            kept = spec.cut_copy(draft.tokens, limit)
            if kept or not spec.width.should_draft(limit):
                return Draft(kept, copied=True)
            # No copied token pays, the drafter's drafts may (or their probe is due): they are drafted
            # instead, so text that offers copies at every round still drafts, measures and probes.
            copy, draft = draft.tokens, proposer.own_draft(context, own, spec.params, spec.draft_gen)
        spec.to_judge(draft.tokens, draft.confidence, copy)
        self.made = len(draft.tokens)
        k = spec.width.choose(draft.confidence, len(draft.tokens), allotted)
        return draft.first(k)
