"""How likely each draft is to be kept, learned from every round, verified or not.

Vocabulary: a draft at position i (1-based after the newest token) is *kept* when the target
commits that very token there, given that drafts 1..i-1 were kept. The keep rate of a position is
conditional in that sense, which is what the expected tokens of a round multiply.

Every drafted block is judged against the tokens the target goes on to commit, not only the
drafts a round verified (`DraftJudge`): a round that verified 2 of 7 drafts and accepted both
still learns about drafts 3.. from the bonus token and the next rounds' tokens. So a width policy
that verifies little keeps learning, and a bad start is forgotten as soon as the drafter does
better. For greedy decoding "committed == drafted" is exactly acceptance; under sampling it
is a lower bound of a draft's acceptance for drafts beyond the verified ones (equal for those
verified), so sampled runs keep their own `KeepModel`.

Drafters that report a confidence per draft (DFlash, a draft model) get it scaled per position
into a keep probability: measured keep rate over mean confidence of that position's judged
drafts. The scale starts from the drafter's shipped calibration when it has one (`lucebox
distill` measures it), else from 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lucebox.limits import DRAFT_WIDTH

STEP = 0.05  # weight of one judged draft in the running means once many were (about the last 20 count)
PRIOR_COUNT = 4  # judged drafts the starting figures are worth: the first judgements move them fast


def _blend(old: float, new: float, count: int) -> float:
    step = max(STEP, 1 / (count + PRIOR_COUNT))  # a running average while few drafts were judged
    return (1 - step) * old + step * new


@dataclass
class KeepModel:
    """Per draft position: the running keep rate and, for drafters with confidences, the running
    mean confidence of the same judged drafts."""

    kept: list[float] = field(default_factory=lambda: [0.6] * DRAFT_WIDTH)
    confidence: list[float] = field(default_factory=lambda: [0.6] * DRAFT_WIDTH)
    judged: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * DRAFT_WIDTH)  # judged drafts per position

    @classmethod
    def from_calibration(cls, kept: list[float], confidence: list[float]) -> KeepModel:
        """Start from measured figures (a drafter's shipped calibration); positions past them copy the last."""
        def padded(values: list[float]) -> list[float]:
            values = [min(max(float(v), 0.01), 1.0) for v in values[:DRAFT_WIDTH]] or [0.6]
            return values + [values[-1]] * (DRAFT_WIDTH - len(values))
        return cls(padded(kept), padded(confidence))

    def judge(self, position: int, kept: bool, confidence: float | None) -> None:
        """One draft at 0-based `position` judged (its predecessors were kept)."""
        count = self.counts[position]
        self.kept[position] = _blend(self.kept[position], float(kept), count)
        if confidence is not None:
            self.confidence[position] = _blend(self.confidence[position], confidence, count)
        self.counts[position] += 1
        self.judged += 1

    def predict(self, confidence: list[float] | None, count: int) -> list[float]:
        """Keep probabilities of the first `count` drafts: their confidences calibrated per position,
        or the measured keep rates when the drafter reports none."""
        count = min(count, DRAFT_WIDTH)
        if not confidence:
            return self.kept[:count]
        return [self.calibrated(i, c) for i, c in enumerate(confidence[:count])]

    def calibrated(self, position: int, confidence: float) -> float:
        """The keep probability of a draft at 0-based `position` the drafter gave `confidence`."""
        if position >= len(self.kept):
            return 0.0
        return min(1.0, confidence * self.kept[position] / max(self.confidence[position], 1e-6))


def reaches(keep: list[float]) -> list[float]:
    """Each draft's chance of being kept along with every draft before it, from each one's keep
    probability (never above the one before it)."""
    out, reach = [], 1.0
    for p in keep:
        reach *= p
        out.append(reach)
    return out


def expected_tokens(keep: list[float]) -> list[float]:
    """Expected tokens a round commits when it verifies the first k drafts, for k = 0..len(keep):
    1 (the target's own token) plus the chance each draft and all before it are kept."""
    out = [1.0]
    for reach in reaches(keep):
        out.append(out[-1] + reach)
    return out


class DraftJudge:
    """Holds the newest drafted block until the committed tokens have judged each of its drafts."""

    def __init__(self, model: KeepModel):
        self.model = model
        self.pending: list[tuple[int, int, float | None]] = []  # (position, token, confidence)

    def drafted(self, tokens: list[int], confidence: list[float]) -> None:
        """A new block after the newest token replaces whatever an older block still predicted."""
        self.pending = [(i, t, confidence[i] if i < len(confidence) else None) for i, t in enumerate(tokens)]

    def committed(self, tokens: list[int]) -> None:
        """Tokens the target committed after the newest token, in order."""
        for token in tokens:
            if not self.pending:
                return
            position, drafted, confidence = self.pending.pop(0)
            self.model.judge(position, drafted == token, confidence)
            if drafted != token:  # the block's later drafts followed a token that did not come
                self.pending = []
