"""Which rows a turn of `engine.batcher.StepBatcher` runs, and in which forwards: the steps asked
grouped into forwards of at most a row budget (`forwards`), and the drafts of a batch's chains cut
jointly to the rows that pay in the forward they run in (`allot`). Data in, data out: the works'
rows and steps, changed in place where cut."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lucebox.caches import Step

if TYPE_CHECKING:
    from lucebox.engine.batcher import Work


def forwards(steps: list[Work], row_budget: int, rows: Callable[[Work], int]) -> list[list[Work]]:
    """The steps in forwards: those capturing the same layers together, at most `row_budget` rows
    each (a wider step alone), in the order they were asked; `rows`: a step's rows."""
    groups: list[list[Work]] = []
    open_groups: dict[tuple[int, ...], list[Work]] = {}
    for work in steps:
        group = open_groups.get(work.layers)
        if group is None or sum(rows(w) for w in group) + rows(work) > row_budget:
            group = open_groups[work.layers] = []
            groups.append(group)
        group.append(work)
    return groups


def allot(steps: list[Work], row_budget: int, device: torch.device,
          step_seconds: Callable[[int], float] | None) -> tuple[list[list[Work]], int]:
    """The turn's forwards (`forwards`), the drafts that carry their chances of being kept
    (`reach`) cut to those the batch keeps, and how many were cut. The forwards are made with each
    such step at its first row alone; then in each, the drafts likeliest to be kept, whoever's (a
    sure request's deep drafts before an unsure one's first), take the rows the other steps leave
    of `row_budget`; where the step costs are known (`step_seconds(rows)` of a forward: the
    requests' widths are priced by them), only as many as raise the forward's expected tokens per
    second: each costs the forward a row and pays with its chance (each step's own next token
    counted too; a tree's or a copy's drafts are not, which errs toward keeping drafts). A draft's
    chance is never above the one before it, so each step keeps a prefix of its drafts."""
    groups = forwards(steps, row_budget, lambda w: 1 if w.reach is not None else len(w.rows))
    cut = 0
    for works in groups:
        cuttable = [w for w in works if w.reach is not None]
        if not cuttable:
            continue
        fixed = sum(len(w.rows) for w in works if w.reach is None) + len(cuttable)
        likeliest = sorted((-chance, i, j) for j, w in enumerate(cuttable) for i, chance in enumerate(w.reach))
        taken = min(len(likeliest), max(row_budget - fixed, 0))
        if step_seconds is not None:
            tokens = sum(not w.hidden for w in works)  # a prefill chunk's rows make no token
            best, most, taken = tokens / step_seconds(fixed), taken, 0
            for n in range(most):
                tokens -= likeliest[n][0]
                if tokens / step_seconds(fixed + n + 1) > best:
                    best, taken = tokens / step_seconds(fixed + n + 1), n + 1
        kept = [0] * len(cuttable)
        for _, _, j in likeliest[:taken]:
            kept[j] += 1
        for work, drafts in zip(cuttable, kept, strict=True):
            cut += len(work.rows) - 1 - drafts
            cut_to(work, 1 + drafts, device)
    return groups, cut


def cut_to(work: Work, rows: int, device: torch.device) -> None:
    """The step's first `rows` rows alone."""
    if rows < len(work.rows):
        work.rows, work.reach = work.rows[:rows], work.reach[: rows - 1]
        work.step = Step.span(work.step.start, rows, device)
