"""A round's verdict as data: what `chain_round.ChainRound` and `tree_round.TreeRound` return and
`rounds.Speculation.apply` carries out. A round changes no cache, drafter or judge itself: it
drafts, steps the target, decides, and offers the new tokens to the text stage; this says what to
keep of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.generation import Chunk


@dataclass(frozen=True)
class RoundResult:
    # The new tokens the text stage took (n + 1, or fewer at a stop): all are committed, and they are
    # what the judges learn from (each pending drafted block is judged against them).
    chunk: Chunk
    rows: list[int]  # the ids of the rows kept, [last, d1, ...]: one per token of `chunk`
    written: int  # rows the step wrote: `last` and every draft row it verified
    # The kept rows below the root, in step order (a tree's accepted path), which the caches move to
    # the positions after `last` before committing; None: a chain's kept rows are in place already.
    path: list[int] | None
    features: torch.Tensor | None  # the kept rows' target features, for the drafter (its `feature_layers`)
    accepted: int  # drafts accepted (n)
    depth: int  # drafts on the deepest path verified (a chain's every draft)
    confidence: list[float]  # the drafter's confidence in a chain's verified drafts (a tree reports none)
    shape: str  # "chain" | "tree": the `tree_width.ShapeRates` rate this round's time teaches
    drafted: bool  # the round drafted: the time before its step was drafting
    # The drafts were the drafter's own pass (not a copy of earlier text, nor the grammar's forced
    # tokens): only then does the drafting time price the drafter, and the round teach its shape.
    own_drafts: bool
    began: float  # clock reading when the round began (before drafting)
    stepped: float  # clock reading when drafting was done (before the step)
    forward_rows: int | None = None  # rows of the forward its step ran in, when shared with other requests'
    drafts_made: int = 0  # drafts the drafter made (verified or not): a sequential drafter's time is per draft
    waited_s: float = 0.0  # seconds its step waited for that forward to start
