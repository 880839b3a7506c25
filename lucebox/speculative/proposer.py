"""What every drafter provides. The verifier never knows where drafts came from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache

import torch

from lucebox.draft import Draft
from lucebox.graph_capture import Graphed
from lucebox.limits import DRAFT_WIDTH
from lucebox.sampling import RaceNoise, SamplingParams, distribution, draw
from lucebox.speculative.tree import DraftTree

Noise = torch.Generator | RaceNoise | None  # what sampled drafts are drawn with (None: greedy)


class Proposer(ABC):
    """Drafts continuations of the committed tokens.

    The engine calls `start` with the prompt once its rows are in the target cache, then per round
    `propose` (committed tokens and the newest token `last`, which the target has not seen yet)
    and, after verification, `commit` with the tokens now committed and, if `feature_layers` is
    set, the target's outputs of those layers for them (from the verifying forward itself).

    Abilities are declared, never probed: `drafts_trees` (a `TreeProposer`), and `graph`, the
    drafter's pass as one CUDA graph (`draft_graph.DraftGraph`, `mtp_graph.MTPGraph`) once
    `graph_with` made it."""

    name: str = "drafter"  # what the stats call it ("drafter" in `Generation.stats`)
    # Each draft is a pass of its own (an MTP head, a draft model): drafting costs per draft, not per
    # round, so a round drafts only as deep as the width policy expects to pay (`WidthPolicy.depth`,
    # `propose(..., own_k=)`). The first draft's pass also writes the rows committed since the last.
    sequential: bool = False
    feature_layers: tuple[int, ...] = ()
    max_width: int = DRAFT_WIDTH
    drafts_trees: bool = False
    graph: Graphed | None = None  # None: the drafter's passes run eagerly (or it has none of fixed shape to graph)

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:  # noqa: B027 - optional
        """A new request begins with `prompt` committed."""

    @abstractmethod
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Noise) -> Draft:
        """Up to k drafts continuing `context` (committed tokens + last). Sampled drafts race their
        distribution against `generator` when it is the request's `RaceNoise` (deterministic
        drafts, q None), or are drawn from it when it is a torch generator."""

    def own_draft(self, context: list[int], k: int, params: SamplingParams, generator: Noise) -> Draft:
        """`propose`, never a copy of earlier text: the drafter's own drafts, which a round asks for
        when a copy was on offer but its keep rates pay for none of it. A proposer that never
        copies has nothing else to give."""
        return self.propose(context, k, params, generator)

    def commit(self, committed: list[int], new: int, features: torch.Tensor | None) -> None:  # noqa: B027
        """The last `new` tokens of `committed` were just committed (features: their rows)."""

    def resume(self, position: int) -> bool:
        """A new request keeps the previous one's first `position` committed tokens (the engine's
        prefix reuse): True when this drafter's state for them is intact and now ends there, so
        `start` is skipped and only the rest is committed to it; False (the default) restarts it."""
        return False

    def copies(self, context: list[int]) -> bool:
        """Whether the next draft after `context` is a copy of earlier text (prompt lookup): a
        round then drafts whatever the width policy expects of the drafter."""
        return False

    def device_bytes(self) -> int:
        """Weights and caches the drafter holds (0 for weightless drafters)."""
        return 0

    def weight_bytes(self) -> int:
        """The part of `device_bytes` its forks share (`fork`)."""
        return 0

    def fork(self) -> Proposer | None:
        """A drafter like this one, sharing its weights and settings, with a state of its own (empty
        until `start`): another stream's, when several run at once. None: this drafter serves one
        stream (the others decode without one)."""
        return None

    def graph_with(self, capture: bool, pool=None) -> None:  # noqa: B027 - optional
        """Run the drafter's passes as one graph from now on (captured on the first when `capture`),
        in the target steps' memory `pool`; a drafter with no pass of fixed shape keeps running eagerly."""

    def capture_graph(self, token: int) -> None:  # noqa: B027 - only where `graph_with` made a graph
        """Run the graphed pass once, over the drafter's empty caches, leaving them empty: a
        capture at start-up, so that no request pays for it (`token`: any id)."""


class TreeProposer(Proposer):
    """A drafter that also drafts trees (`speculative.tree`): several continuations of `last`, which
    one target step verifies at once (`tree_round.TreeRound`)."""

    drafts_trees = True

    @abstractmethod
    def propose_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                     noise: RaceNoise | None = None) -> DraftTree:
        """A tree of up to `budget` draft rows after `last` (context[-1]), or a copy of earlier text
        as a chain (`DraftTree.copied`). Sampled coupled trees (`noise` given) rank each position's
        tokens by their race against it."""

    @abstractmethod
    def own_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                 noise: RaceNoise | None = None) -> DraftTree:
        """`propose_tree` never copying (as `own_draft` is `propose`)."""


def tensor_bytes(tensors) -> int:
    """Device bytes of plain and quantized weights (and expert caches: their slots), bytes shared
    by views counted once: an attention layer's wq, wk, wv are views of its fused projection."""
    spans: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges of the tensors in it
    others = 0
    for t in tensors:
        fields = ("codes", "scales", "zeros", "mins")
        parts = [t] if isinstance(t, torch.Tensor) else [getattr(t, f, None) for f in fields]
        if not isinstance(parts[0], torch.Tensor):  # an expert cache
            others += t.nbytes()
            continue
        for part in (p for p in parts if p is not None):
            start, size = part.storage_offset() * part.element_size(), part.numel() * part.element_size()
            spans.setdefault(part.untyped_storage().data_ptr(), []).append((start, start + size))
    return others + sum(_union_length(ranges) for ranges in spans.values())


def _union_length(ranges: list[tuple[int, int]]) -> int:
    total, reached = 0, 0
    for start, end in sorted(ranges):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total


def top_probabilities(logits: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """The drafter's belief in each of its drafts, on the device, (k,): see `confidence`."""
    probs = torch.softmax(logits.float(), dim=-1) if q is None else q
    return probs.max(dim=-1).values.reshape(-1)


def chosen_draft(q: torch.Tensor, params: SamplingParams, generator: Noise, position: int) -> torch.Tensor:
    """The draft (a () tensor, on the device) for the token at `position` from its distribution q (V,):
    the argmax (greedy), the winner of the request's race there (coupled), or a draw."""
    if params.greedy:
        return q.argmax()
    if isinstance(generator, RaceNoise):
        return generator.choose(q[None], torch.tensor([position], device=q.device))[0]
    return draw(q, generator)


def read_drafts(tokens: list[torch.Tensor], q_rows: list[torch.Tensor], logits: list[torch.Tensor],
                params: SamplingParams, generator: Noise) -> Draft:
    """A sequential drafter's drafts (`chosen_draft` each), their distributions and logits, read from
    the device at once (a read waits for every queued kernel); q is kept only for drafts drawn."""
    k = len(tokens)
    q = None if params.greedy or isinstance(generator, RaceNoise) else torch.stack(q_rows)  # None: deterministic
    beliefs = top_probabilities(torch.stack(logits), q)
    read = torch.cat([torch.stack(tokens).double(), beliefs.double()]).tolist()  # ids < 2^53: exact
    return Draft([int(t) for t in read[:k]], q, read[k:])


def greedy_draft(logits: torch.Tensor, confidences: torch.Tensor | None = None) -> Draft:
    """The argmax drafts of logits (k, V) and their confidences (given (k,), or the top-1 mass of
    the logits' softmax), read from the device at once."""
    tokens = logits.argmax(-1)
    belief = top_probabilities(logits, None) if confidences is None else confidences
    both = torch.cat([tokens.double(), belief.double()]).tolist()  # ids < 2^53: exact
    k = tokens.shape[0]
    return Draft([int(t) for t in both[:k]], None, both[k:])


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(k, V) float64: the distributions sampled drafts are drawn from, for logits (k, V) under
    `params`' temperature and truncation (no repetition penalty: that is the verifier's)."""
    nothing = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    return distribution(logits, _unpenalized(params), nothing).double()


@lru_cache(maxsize=16)
def _unpenalized(params: SamplingParams) -> SamplingParams:
    """`params` without its penalties, made once per request's params: a draft pass asks at every
    position, and each new `SamplingParams` is checked field by field (~20 us)."""
    return SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p)


def raced_scores(logits: torch.Tensor, params: SamplingParams, noise: RaceNoise, first: int) -> torch.Tensor:
    """(k, V) float64: the race scores of drafts for positions first, first + 1, ... from the
    drafter's logits (k, V) under `params` (`RaceNoise.scores`): their argmax is the coupled draft,
    their softmax its confidence, and a tree's top-k per position its likeliest race winners."""
    positions = torch.arange(first, first + logits.shape[0], device=logits.device)
    return noise.scores(draft_distribution(logits, params), positions)


def confidence(logits: torch.Tensor, q: torch.Tensor | None) -> list[float]:
    """The drafter's belief in each of its drafts, for the width policy: the top-1 mass of the
    distribution a sampled draft was drawn from (`q`, (k, V)), or for greedy drafts (q None: the
    sampling distribution is one-hot there) of the drafter's own softmax over its logits (k, V)."""
    return top_probabilities(logits, q).tolist()
