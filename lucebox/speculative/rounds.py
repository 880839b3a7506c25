"""The speculation stage of a request: rounds of draft, verify, commit.

Contract: the stage works only with what its `DecodeContext` hands it (runner, cache, clock,
verify-cost table, limits, rules) and owns its `RoundState`: `tokens`, the ids whose rows the
cache holds (the prompt, then every committed token), the newest token and the penalties'
history. `first(logits)` chooses the token after the prompt (from the prefill's last row). Each
`round(remaining, take)` runs a chain round (`chain_round.ChainRound`) or, for drafters that make
trees, a tree round (`tree_round.TreeRound`): it drafts after the newest token, runs one target
step through the runner, decides, and offers the new tokens to `take` (the text stage), which
returns the chunk of those it accepts: all of them, or the ones up to a stop. The round returns
its verdict (`round_result.RoundResult`) and `apply`, the one ending of every round, commits it:
only the accepted tokens' rows, to the cache and the drafter; every other row is rolled back. So
nothing past a stop is ever committed. Host reads of device values per round: the verdict (one
list), plus the drafts when the drafter makes them on the device (DFlash, a draft model).
`stats()` sums the rounds for `Generation.stats`.

Under a grammar (`constrained.GrammarState`) rounds are chains (a tree's rows would each need their
own mask) and the grammar commits with the cache.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.device import DeviceClock
from lucebox.generation import Chunk
from lucebox.limits import DECODE_ROWS
from lucebox.logprobs import token_logprobs
from lucebox.sampling import RaceNoise, SamplingParams
from lucebox.speculative.chain_round import ChainRound
from lucebox.speculative.decide import decide
from lucebox.speculative.keep_model import DraftJudge, KeepModel, reaches
from lucebox.speculative.learned import Learned
from lucebox.speculative.proposer import Draft, Proposer
from lucebox.speculative.round_result import RoundResult
from lucebox.speculative.round_state import RoundState
from lucebox.speculative.tree import DraftTree
from lucebox.speculative.tree_round import TreeRound
from lucebox.speculative.width import ProbeSchedule, WidthPolicy, fixed_costs


class TargetOutput(Protocol):
    """What one target step returns (`engine.runner.StepOutput`)."""

    logits: torch.Tensor  # (T, V)
    choices: torch.Tensor  # (T,) each row's argmax, or -1 everywhere if a logit is not finite
    features: torch.Tensor | None  # (T, len(layers) * H): the outputs of the decoder layers asked for
    forward_rows: int | None  # rows of the forward it ran in, when other requests' rows shared it
    waited_s: float  # seconds it waited for its forward to start, when batched with other requests'


class TargetRunner(Protocol):
    """One target step of any width over `rows` at the positions of `step`, writing their K/V into
    `cache` (`engine.runner.StepRunner`); `tree`: the rows are a draft tree. A runner that batches
    requests (`engine.batcher.StepBatcher`) also has `row_share()` and `row_budget`, and its `step`
    takes a chain's `reach`, with which it may run fewer of the rows (`draft_limit`)."""

    def step(self, rows: list[int], step: Step, cache: SequenceCache, layers: tuple[int, ...] = (),
             tree: DraftTree | None = None) -> TargetOutput: ...


@dataclass(frozen=True)
class DecodeContext:
    """What one request's speculation stage works with, handed to it by the engine."""

    runner: TargetRunner
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
        self.state = RoundState(prompt_ids, params, context.vocab_size, context.device)
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
        self.penalized = params.penalized
        self.width = _policy(context, params, proposer is not None, sequential=getattr(proposer, "sequential", False))
        self.judge = DraftJudge(self.width.keep)
        # Prompt-lookup copies have keep rates of their own (repeating text is kept far more often than a
        # drafted block, and under sampling far less than when greedy), learned by their own judge.
        self.copy_width = _policy(context, params, proposer is not None, copies=True)
        self.copy_judge = DraftJudge(self.copy_width.keep)
        # Rounds are timed (a synchronized clock) only where the policy learns from the times; the
        # wait is short, since every round reads its verdict (and its drafts) on the host anyway.
        self.timed = self.width.has_drafter and self.width.timed and self.width.adaptive
        self.totals = RoundTotals()
        self.chain = ChainRound(self)
        # Trees from drafters that make them (DFlash). Sampled rounds of the other rules keep chains
        # unless the width is fixed: a tree keeps only exact matches of the target's sample, a chain
        # keeps min(1, p/q) of each draft, which under those rules keeps more. Coupled trees hold the
        # likeliest winners of the very race the target runs.
        trees = (context.tree_budget > 0 and proposer is not None and proposer.drafts_trees and grammar is None
                 and (params.greedy or context.verify_rule == "coupled" or not context.adaptive))
        self.tree = TreeRound(self) if trees else None
        # Adaptive timed rounds choose chain or tree by the rates each delivered; else always the tree.
        mode = "greedy" if params.greedy else "sampled"
        self.shapes = context.learned.shapes[mode] if trees and self.timed and context.learned is not None else None

    def first(self, logits: torch.Tensor) -> int:
        if self.grammar is not None:
            logits, _ = self.grammar.constrain(logits, Draft([]))
        verdict = decide(logits, Draft([]), self.params, self.state.seen, self.context.verify_rule, self.verify_gen,
                         position=len(self.state.tokens), counts=self.state.counts)
        if self.grammar is not None:
            self.grammar.commit([verdict.next_token])
        self.state.advance([verdict.next_token])
        return verdict.next_token

    def round(self, remaining: int, take: Callable[[list[int]], Chunk]) -> Chunk:
        """One round; `remaining`: tokens the request may still produce."""
        # a grammar that arrives mid-request (a spent thought budget's close) takes chains, as one from the start
        tree = (self.tree is not None and self.grammar is None
                and (self.shapes is None or self.shapes.choose() == "tree"))
        result = (self.tree if tree else self.chain).run(remaining, take)
        self.apply(result)
        return result.chunk

    def apply(self, result: RoundResult) -> None:
        """Carry out a round's verdict, the one ending of every round: the kept rows stay (a tree's
        path moved into place first) and the rest of the step's rows are rolled back, in every cache;
        the grammar and the drafter commit the same tokens; then the judges learn from them, and the
        totals, the width policy and the shape rates take the round's times (its step's measured
        through the commit)."""
        cache, state, new = self.context.cache, self.state, result.chunk.token_ids
        if result.path is not None:
            cache.accept_path(cache.length, result.path)
        if self.grammar is not None:
            self.grammar.commit(new)
        end = cache.length + len(result.rows)
        cache.commit(end)
        if len(result.rows) < result.written:
            cache.rollback(end)  # rejected drafts' rows (and any past a stop) leave every cache
        state.commit(result.rows)
        if self.proposer is not None:
            self.proposer.commit(state.tokens, len(result.rows), result.features)
        done = self.context.clock(self.timed)
        self.judged(new)
        drafting, step = result.stepped - result.began, done - result.stepped
        self.totals.add(result, drafting if result.drafted else 0.0, step)
        # A copy's lookup is not the drafter's pass: its time would price the drafter at next to nothing.
        # A batched step's time is its forward's, of every request's rows: it prices that many, without
        # the time it waited for the forward to start (the others' drafting and forwards).
        self.width.record(result.forward_rows or result.written, max(step - result.waited_s, 0.0),
                          drafting if result.own_drafts else None, result.drafts_made)
        if self.shapes is not None and result.own_drafts:  # a copy is a chain, whatever the shape
            self.shapes.record(result.shape, len(new), done - result.began)
        state.advance(new)

    def draft_limit(self, remaining: int, allotted: bool = False) -> int:
        """The most drafts (or draft rows of a tree) this round may verify. A runner that batches
        requests gives each its share of a step's rows, so the steps of all fit one forward; with
        `allotted`, a request whose widths are priced by the step costs may draft as many as one
        forward takes, the step carrying their chances of being kept (`reach`): the runner keeps
        those that pay, the likeliest of every request's (`engine.turn_rows.allot`). Neither where
        the tokens depend on the widths drafted (sampled, verified tokenwise or as a block): there
        the widths, which would follow the other requests, would change them."""
        cache, runner = self.context.cache, self.context.runner
        share = cache.settings.decode_rows
        if self.widths_follow_the_batch and hasattr(runner, "row_share"):
            share = runner.row_budget if allotted and self.width.priced else runner.row_share()
        return min(remaining - 1, cache.rows_before_reselect(cache.length) - 1, cache.settings.max_step - 1,
                   cache.settings.decode_rows - 1, share - 1, self.context.draft_k)

    @property
    def widths_follow_the_batch(self) -> bool:
        """Whether this request's widths may follow the other requests' (its tokens do not depend on them)."""
        return self.params.greedy or self.context.verify_rule == "coupled"

    def reach(self, draft: Draft) -> list[float]:
        """Each draft's chance of being kept along with every draft before it, as the width policy
        predicts it (non-increasing)."""
        out = reaches(self.width.keep.predict(draft.confidence, len(draft.tokens)))
        return out + [0.0] * (len(draft.tokens) - len(out))  # past what the keep rates cover

    def drafting(self, limit: int, context: list[int]) -> bool:
        """Whether this round drafts: always when the proposer has a copy of earlier text to offer
        (it costs next to nothing; the copies' keep rates cut it), else as the width policy expects
        the drafter to pay."""
        if limit > 0 and self.proposer is not None and self.proposer.copies(context):
            return True
        return self.width.should_draft(limit)

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

    def attach_logprobs(self, chunk: Chunk, logits: torch.Tensor, rows: list[int] | None = None) -> Chunk:
        """`chunk` with its tokens' logprobs when the request asked for them: token i was chosen by
        row i of `logits` (T, V) (or by row rows[i]), the target's raw logits (`lucebox.logprobs`)."""
        if self.top_logprobs is not None and chunk.token_ids:
            chunk.logprobs = token_logprobs(logits if rows is None else logits[rows], chunk.token_ids,
                                            self.top_logprobs)
        return chunk

    def stats(self) -> dict:
        drafter = None if self.proposer is None else self.proposer.name
        return {**self.totals.as_stats(), "drafter": drafter, **({} if self.grammar is None else self.grammar.stats())}


def _policy(context: DecodeContext, params: SamplingParams, has_drafter: bool, copies: bool = False,
            sequential: bool = False) -> WidthPolicy:
    """Adaptive with the engine's shared costs, keep rates (of the drafter, or of prompt-lookup
    `copies`) and the drafter's probe schedule of this mode; fixed without them (copies then
    verified whole). A seeded sampled
    request verified by drawn outcomes (tokenwise, block) decides without clocks from a fresh copy
    of the calibration, since its tokens depend on the widths it used; coupled rounds commit the
    same tokens whatever the widths, so their seeded requests use the clock too."""
    learned = context.learned
    if learned is None or not context.adaptive:
        return WidthPolicy(fixed_costs(), KeepModel(), adaptive=False, has_drafter=has_drafter, sequential=sequential)
    reproducible = not params.greedy and params.seed is not None and context.verify_rule != "coupled"
    if reproducible:
        return WidthPolicy(fixed_costs(), learned.keep_for(params, True, copies), timed=False, has_drafter=has_drafter,
                           sequential=sequential)
    probes = ProbeSchedule() if copies else learned.probes["greedy" if params.greedy else "sampled"]
    return WidthPolicy(learned.costs, learned.keep_for(params, False, copies), has_drafter=has_drafter, probes=probes,
                       sequential=sequential)


class RoundTotals:
    """The rounds of one request summed: what `Generation.stats` reports about speculation."""

    def __init__(self):
        self.rounds, self.committed = 0, 0
        self.draft_time_s = self.verify_time_s = 0.0
        # per draft position (or per width / kept count), DECODE_ROWS of each
        self.drafted, self.accepted, self.widths, self.kept, self.confident = ([0] * DECODE_ROWS for _ in range(5))
        self.confidence = [0.0] * DECODE_ROWS

    def add(self, result: RoundResult, draft_s: float, verify_s: float) -> None:
        """A round that verified `result.depth` drafts deep (`written` - 1 draft rows: more than its
        deepest path when a tree) and accepted the first `accepted`."""
        n = result.accepted
        for i, c in enumerate(result.confidence):
            self.confidence[i] += c
            self.confident[i] += 1
        self.rounds += 1
        self.committed += n + 1
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s
        self.widths[result.written - 1] += 1
        self.kept[n] += 1
        for i in range(result.depth):
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
