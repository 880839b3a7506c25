"""How many drafts to verify each round, and whether to draft at all: the width with the most
expected tokens per second.

A round costs drafting (once per round, whatever the width) plus one target step over its rows
(which includes committing or rolling back); a plain step costs the step of one row. Both are
measured: the step table at start-up (`measure_verify_seconds`), then every round refines what it
used, plain steps included, and drafting is timed whenever it runs (`RoundCosts`). Expected tokens
come from `KeepModel`'s per-position keep probabilities.

Two decisions per round:
- before drafting, from the measured keep rates: does a round of the best width beat a plain
  step, drafting cost included? If not, the round is plain, but after `PROBE_EVERY` plain rounds
  the drafter runs anyway (its block is judged against what gets committed), so a policy that
  stopped drafting after a bad stretch starts again when the drafter does better. Each probe
  that leaves drafting unpaid doubles the wait before the next (up to `MAX_PROBE_EVERY`), so
  where drafting never pays (sampled text the drafter cannot follow) probes cost little; a round
  that pays again resets it. The schedule (`ProbeSchedule`) is the engine's, per decoding mode,
  as the keep rates are: a new request does not start probing every 8 rounds again;
- after drafting, from the block's own confidences: the width that maximizes tokens per second
  of what is left to pay (verification; the drafting is spent), or 0.

A seeded sampled run decides without clocks (`timed=False`), so that its tokens, which depend on
the widths it used (its distribution does not), are reproducible: it always drafts and verifies
while the chance of reaching a draft stays above `MIN_REACH`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lucebox.limits import DECODE_ROWS, DRAFT_WIDTH
from lucebox.speculative.keep_model import KeepModel, expected_tokens, reaches

PROBE_EVERY = 8  # plain rounds before a draft the policy did not expect to pay (doubling while none pays)
MAX_PROBE_EVERY = 64  # the longest wait between two probes
MIN_REACH = 0.25  # untimed runs verify drafts while the chance of reaching them stays above this
SMOOTHING = 0.05  # how fast older step and drafting times fade (about the last 20 count)
PRIOR_WEIGHT = 0.2  # weight of each start-up measurement in the step-time fit, never faded
# A measured time counts as at most this many times its current estimate. A stall of the machine
# (another process, a page fault) can make one round 50x slower; counted in full it would price
# drafting out for hundreds of rounds, and plain rounds never teach drafting's cost back. A lasting
# slowdown is still followed: each clipped measurement moves the estimate up, and the next clip
# starts from there.
STALL_CLIP = 3.0


class RoundCosts:
    """Seconds of a target step of `rows` rows, as a line a + b * rows fitted (least squares) to
    every step measured, the older ones weighing less; and of one drafting, a running mean.

    One line pools what every width teaches (a plain step's time informs the widest round's), so a
    noisy measurement moves every estimate a little instead of one width's a lot, and widths never
    tried are priced too. The start-up table stays in the fit with a small fixed weight, which
    keeps the slope known when the rounds all use one width."""

    def __init__(self, step_seconds: dict[int, float], draft_seconds: float | None = None):
        self.draft_seconds = draft_seconds  # None until the drafter has been timed
        # The engine's first drafting also writes the prompt into the drafter's rings and pays its
        # first-call costs (up to 5x a later one): left out, so it cannot price drafting out at the start.
        self._first_drafting_seen = draft_seconds is not None
        self._prior = [0.0] * 5  # sums of weight, x, x^2, y, x*y of the start-up table
        self._seen = [0.0] * 5  # the same of the measured steps, decayed
        for rows, seconds in step_seconds.items():
            self._prior = [a + b for a, b in zip(self._prior, _moments(rows, seconds, PRIOR_WEIGHT), strict=True)]

    def step(self, rows: int) -> float:
        return _on_line(self.line(), rows)

    def line(self) -> tuple[float, float]:
        """(a, b) of the fitted line a + b * rows (what `step` evaluates: fit once, price many widths)."""
        n, sx, sxx, sy, sxy = (a + b for a, b in zip(self._prior, self._seen, strict=True))
        spread = n * sxx - sx * sx
        slope = max(0.0, (n * sxy - sx * sy) / spread) if spread > 1e-12 else 0.0
        return (sy - slope * sx) / n, slope

    def drafting(self) -> float:
        return self.draft_seconds if self.draft_seconds is not None else 0.0

    def refine_step(self, rows: int, seconds: float) -> None:
        seconds = min(seconds, STALL_CLIP * self.step(rows))
        self._seen = [(1 - SMOOTHING) * a + b for a, b in zip(self._seen, _moments(rows, seconds, 1.0), strict=True)]

    def refine_drafting(self, seconds: float) -> None:
        if not self._first_drafting_seen:
            self._first_drafting_seen = True
            return
        old = self.draft_seconds
        if old is None:
            self.draft_seconds = seconds
        else:
            self.draft_seconds = (1 - SMOOTHING) * old + SMOOTHING * min(seconds, STALL_CLIP * old)


def _moments(x: float, y: float, weight: float) -> list[float]:
    return [weight, weight * x, weight * x * x, weight * y, weight * x * y]


def _on_line(line: tuple[float, float], rows: int) -> float:
    return max(line[0] + line[1] * rows, 1e-9)


@dataclass
class ProbeSchedule:
    """When the drafter next runs although no width is expected to pay: after `every` plain rounds."""
    plain_rounds: int = 0  # plain rounds since the drafter last ran
    every: int = PROBE_EVERY


@dataclass
class WidthPolicy:
    costs: RoundCosts
    keep: KeepModel = field(default_factory=KeepModel)
    max_width: int = DRAFT_WIDTH
    timed: bool = True
    adaptive: bool = True  # False: always the widest round the limits allow, always drafting
    has_drafter: bool = True
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)  # the engine's, by mode (`Learned`)
    # Drafting costs per draft (`Proposer.sequential`): the costs' drafting time is one draft's.
    sequential: bool = False

    def rate(self, keep: list[float], drafting: float) -> tuple[int, float]:
        """(width, expected tokens per second) of the best round given keep probabilities and the
        drafting cost still to pay (a sequential drafter's: per draft); width 0 is a plain step."""
        line = self.costs.line()
        best_k, best = 0, 1.0 / _on_line(line, 1)
        for k, tokens in enumerate(expected_tokens(keep)[1:], start=1):
            rate = tokens / (drafting * (k if self.sequential else 1) + _on_line(line, k + 1))
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    @property
    def priced(self) -> bool:
        """Whether widths are chosen by the measured step costs (not fixed, not by keep rates alone)."""
        return self.adaptive and self.timed

    def should_draft(self, limit: int) -> bool:
        """Before drafting: whether a round of up to `limit` drafts is expected to beat a plain step."""
        if not self.has_drafter or limit <= 0:
            return False
        if not self.adaptive or not self.timed:
            return True
        probes = self.probes
        if self.rate(self.keep.predict(None, min(limit, self.max_width)), self.costs.drafting())[0] > 0:
            probes.plain_rounds, probes.every = 0, PROBE_EVERY
            return True
        probes.plain_rounds += 1
        if probes.plain_rounds >= probes.every:
            probes.plain_rounds = 0
            probes.every = min(2 * probes.every, MAX_PROBE_EVERY)
            return True
        return False

    def depth(self, limit: int) -> int:
        """How many drafts a sequential drafter makes this round (up to `limit`): one past the width
        the keep rates expect to pay, so that confident drafts can go deeper; at least one (a probe)."""
        if not self.sequential or not self.adaptive or not self.timed:
            return limit
        best = self.rate(self.keep.predict(None, min(limit, self.max_width)), self.costs.drafting())[0]
        return max(1, min(limit, best + 1))

    def choose(self, confidence: list[float] | None, available: int, limit: int) -> int:
        """After drafting: how many of the `available` drafts to verify (at most `limit`)."""
        count = min(available, limit, self.max_width)
        if not self.adaptive:
            return count
        keep = self.keep.predict(confidence, count)
        if not self.timed:
            return next((k for k, reach in enumerate(reaches(keep)) if reach < MIN_REACH), len(keep))
        return self.rate(keep, 0.0)[0]

    def record(self, rows: int, step_seconds: float, draft_seconds: float | None, drafts: int = 1) -> None:
        """A round's measured times: its target step of `rows` rows (with its commit) and its
        drafting of `drafts` drafts (None when it did not draft)."""
        if not self.timed or not self.adaptive:
            return
        self.costs.refine_step(rows, step_seconds)
        if draft_seconds is not None:
            self.costs.refine_drafting(draft_seconds / max(drafts, 1) if self.sequential else draft_seconds)
            self.probes.plain_rounds = 0


def fixed_costs() -> RoundCosts:
    """A cost table for policies that never consult it (fixed width, untimed)."""
    return RoundCosts({1: 1.0, DECODE_ROWS: 1.0})
