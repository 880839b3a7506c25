"""How many drafts to verify each round, and whether to speculate at all.

Verify cost grows with width (measured once at start-up, then refined by every round); the
expected tokens of a round grow with the drafter's confidence. Each round takes the width that
maximizes expected tokens per second; a request whose speculative rounds turn out slower than
plain decoding stops speculating.

Timings vary from run to run, and a sampled run's tokens depend on the widths it used (its
distribution does not). So a seeded sampled run decides without clocks (`timed=False`): it trims
the block where the product of the drafter's confidences falls below `min_reach`, and keeps
speculating, which makes it reproducible."""

from __future__ import annotations

from dataclasses import dataclass, field

from lucebox.engine.config import DECODE_ROWS, DRAFT_WIDTH


@dataclass
class WidthPolicy:
    max_width: int
    verify_seconds: dict[int, float]  # rows -> seconds of one target forward (measured)
    min_rounds: int = 8  # rounds before judging the speed-up
    speculating: bool = True
    timed: bool = True
    min_reach: float = 0.25
    _tokens: int = 0
    _seconds: float = 0.0
    _rounds: int = field(default=0)
    # Measured chance that a draft is kept given the ones before it were: the confidence of
    # drafters that give none (n-gram), the same for every position so that widths never tried
    # still learn from the ones that were. Starts hopeful, then follows what happens.
    kept_rate: float = 0.7
    # Drafters' confidences are beliefs, not keep rates: a greedy draft is kept whenever its top
    # token is the target's, which happens more often than its top-1 mass says. Measured keep rate
    # over mean confidence, both averaged over the drafts judged so far, scales confidences into
    # keep probabilities (1.0 until drafts have been judged).
    _kept_mean: float = 1.0
    _confidence_mean: float = 1.0

    @property
    def calibration(self) -> float:
        return self._kept_mean / max(self._confidence_mean, 1e-6)

    def cost(self, rows: int) -> float:
        """Seconds of a forward of `rows` rows, interpolated between measured widths."""
        known = sorted(self.verify_seconds)
        lower = max((w for w in known if w <= rows), default=known[0])
        upper = min((w for w in known if w >= rows), default=known[-1])
        if upper == lower:
            return self.verify_seconds[lower] * (rows / lower if rows > upper else 1.0)
        t = (rows - lower) / (upper - lower)
        return self.verify_seconds[lower] * (1 - t) + self.verify_seconds[upper] * t

    def choose(self, confidence: list[float] | None, available: int, limit: int) -> int:
        """Drafts to verify (of `available`), from the drafter's per-position confidence (or the
        measured keep rates when it gives none) and the cost model."""
        if not self.speculating:
            return 0
        if not confidence:
            confidence = [self.kept_rate] * available
        else:
            confidence = [min(1.0, c * self.calibration) for c in confidence]
        if not self.timed:
            k, reach = 0, 1.0
            for c in confidence[: min(limit, self.max_width)]:
                reach *= c
                if reach < self.min_reach:
                    break
                k += 1
            return k
        best_k, best_rate, expected, reach = 0, 1.0 / self.cost(1), 1.0, 1.0
        for k, c in enumerate(confidence[: min(limit, self.max_width)], start=1):
            reach *= c
            expected += reach
            rate = expected / self.cost(k + 1)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def record(self, committed: int, round_seconds: float, verify_seconds: float, rows: int, proposed: bool,
               confidence: list[float] | None = None) -> None:
        """One round's outcome (draft + verify); turns speculation off if it does not pay. A
        round that drafted and then verified nothing still counts: its drafting was spent.
        `confidence`: what the drafter said of the drafts verified this round."""
        measured = self.verify_seconds.get(rows)
        if measured is not None and self.timed:  # refine the cost model with what this width really took
            self.verify_seconds[rows] = 0.9 * measured + 0.1 * verify_seconds
        if not proposed:
            return
        for i in range(min(rows - 1, committed)):  # drafts judged: all kept but a rejected last one
            kept = float(i < committed - 1)
            self.kept_rate = 0.9 * self.kept_rate + 0.1 * kept
            if confidence:
                self._kept_mean = 0.95 * self._kept_mean + 0.05 * kept
                self._confidence_mean = 0.95 * self._confidence_mean + 0.05 * confidence[i]
        if not self.timed:
            return
        self._tokens += committed
        self._seconds += round_seconds
        self._rounds += 1
        if self._rounds >= self.min_rounds and self._tokens / self._seconds < 1.0 / self.cost(1):
            self.speculating = False


def width_policy(verify_seconds: dict[int, float] | None, speculating: bool, timed: bool) -> WidthPolicy:
    """A request's policy. `verify_seconds`: the engine's measured cost table, shared by its
    requests so that each refines it for the next; None for a fixed width, never judged and never
    turned off (`adaptive=False`). `speculating`: whether the request has a drafter."""
    if verify_seconds is None:
        return WidthPolicy(DRAFT_WIDTH, {1: 1.0, DECODE_ROWS: 1.0}, min_rounds=2**62, speculating=speculating)
    return WidthPolicy(DRAFT_WIDTH, verify_seconds, timed=timed)
