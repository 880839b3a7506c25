"""Chain or tree: which shape of round pays on this machine, and the path of a tree the keep
rates learn from.

A tree round verifies the drafter's whole tree (`tree_budget` rows): the rows a tree adds beyond
its first-choice chain are each unlikely, but on a GPU a verify row is nearly free until the step
becomes compute-bound, while on a CPU each costs a few percent of a step, and the drafter's
probabilities of its second choices are not calibrated enough to price one row against another
(cutting the tree to the rows of highest calibrated reach was measured slower on this CPU than
verifying all of them: the cut rows held about 0.15 tokens per round and saved no measurable
time). So the choice is made on whole rounds, by the tokens per second each shape delivers.
"""

from __future__ import annotations

from lucebox.speculative.tree import DraftTree
from lucebox.speculative.width import SMOOTHING

EXPLORE_EVERY = 16  # drafting rounds between two tries of the shape the rates do not favour
EXPLORE_EARLY = 4  # the same while either shape has fewer than FEW measured rounds
FEW = 8
SWITCH_MARGIN = 1.1  # the other shape's rate over the current one's that makes rounds switch


def top_path(tree: DraftTree) -> tuple[list[int], list[float]]:
    """The drafter's first choice at every depth the tree reaches (each row's most likely child:
    rows are best first within a depth) and its probability: the chain the keep rates learn from."""
    tokens, confidence, row = [], [], 0
    while True:
        child = next((i for i in range(row + 1, len(tree)) if tree.parents[i] == row), None)
        if child is None:
            return tokens, confidence
        tokens.append(tree.tokens[child])
        confidence.append(tree.probabilities[child] / max(tree.probabilities[row], 1e-12))
        row = child


class ShapeRates:
    """Whether a round drafts a chain or a tree, from the tokens per second each has delivered.

    A tree keeps more tokens per round than the chain inside it, but costs more rows to verify and
    more drafting; which pays depends on the machine (on a GPU a row is nearly free until the step
    becomes compute-bound, on a CPU each costs a few percent of a step). So rounds of each shape
    are timed whole (drafting, verification, commit) and their rates kept as running means; a
    round takes the faster shape (the one in use until the other is faster by a margin), and every
    `EXPLORE_EVERY` drafting rounds (every fourth while either has few measurements) the other, so
    the choice follows the machine and the text."""

    def __init__(self):
        self.rates: dict[str, float] = {}
        self.counts = {"chain": 0, "tree": 0}
        self.rounds = 0
        self.current: str | None = None  # the shape rounds take (but for exploring), once both were tried

    def choose(self) -> str:
        self.rounds += 1
        best = self._best()
        if all(self.counts.values()):
            self.current = best
        explore = EXPLORE_EARLY if min(self.counts.values()) < FEW else EXPLORE_EVERY
        if self.rounds % explore == 0:
            return "tree" if best == "chain" else "chain"
        return best

    def _best(self) -> str:
        """Untried shapes first; then the shape in use until the other's rate beats it by `SWITCH_MARGIN`,
        so two shapes about as fast do not swap on a noisy round (runs of one command then agree)."""
        untried = [s for s in self.counts if self.counts[s] == 0]
        if untried:
            return untried[0]
        if self.current is None:
            return max(self.rates, key=self.rates.get)
        other = "tree" if self.current == "chain" else "chain"
        return other if self.rates[other] > SWITCH_MARGIN * self.rates[self.current] else self.current

    def record(self, shape: str, tokens: int, seconds: float) -> None:
        """A drafting round of `shape` committed `tokens` in `seconds`."""
        count = self.counts[shape]
        step = max(SMOOTHING, 1 / (count + 1))  # a plain average while few rounds were measured
        rate = tokens / max(seconds, 1e-9)
        self.rates[shape] = rate if count == 0 else (1 - step) * self.rates[shape] + step * rate
        self.counts[shape] = count + 1
