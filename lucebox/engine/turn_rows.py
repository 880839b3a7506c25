"""Which rows a turn of `engine.batcher.StepBatcher` runs, and in which forwards: the steps asked
grouped into forwards of at most a row budget (`forwards`), and the drafts of a batch's chains cut
jointly to the rows that pay (`allot`). Data in, data out: the works' rows and steps, changed in
place where cut."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lucebox.caches import Step

if TYPE_CHECKING:
    from lucebox.engine.batcher import Work


def forwards(steps: list[Work], row_budget: int) -> list[list[Work]]:
    """The steps in forwards: those capturing the same layers together, at most `row_budget` rows
    each (a wider step alone), in the order they were asked."""
    groups: list[list[Work]] = []
    open_groups: dict[tuple[int, ...], list[Work]] = {}
    for work in steps:
        group = open_groups.get(work.layers)
        if group is None or sum(len(w.rows) for w in group) + len(work.rows) > row_budget:
            group = open_groups[work.layers] = []
            groups.append(group)
        group.append(work)
    return groups


def allot(steps: list[Work], row_budget: int, device: torch.device, line: tuple[float, float] | None) -> int:
    """The drafts that carry their chances of being kept (`reach`) cut, per forward (steps with the
    same feature layers), to those the batch keeps: every such step keeps its first row, and the
    drafts likeliest to be kept, whoever's (a sure request's deep drafts before an unsure one's
    first), take the rows the others leave of `row_budget`. Where every such step is `priced` and
    the step costs are known (`line`: seconds a + b * rows of a forward), only as many as raise
    the forward's expected tokens per second: each costs the forward a row, and pays with its
    chance. A draft's chance is never above the one before it, so each step keeps a prefix of its
    drafts. Returns the drafts cut."""
    cut = 0
    by_layers: dict[tuple[int, ...], list[Work]] = {}
    for work in steps:
        by_layers.setdefault(work.layers, []).append(work)
    for works in by_layers.values():
        cuttable = [w for w in works if w.reach is not None]
        if not cuttable:
            continue
        fixed = sum(len(w.rows) for w in works if w.reach is None) + len(cuttable)
        likeliest = sorted((-chance, i, j) for j, w in enumerate(cuttable) for i, chance in enumerate(w.reach))
        taken = min(len(likeliest), max(row_budget - fixed, 0))
        if line is not None and all(w.priced for w in cuttable):
            a, b = line
            tokens = sum(not w.hidden for w in works)  # each step's own next token (a prefill chunk's: none)
            best, taken, most = tokens / (a + b * fixed), 0, taken
            for n in range(most):
                tokens -= likeliest[n][0]
                if tokens / (a + b * (fixed + n + 1)) > best:
                    best, taken = tokens / (a + b * (fixed + n + 1)), n + 1
        kept = [0] * len(cuttable)
        for _, _, j in likeliest[:taken]:
            kept[j] += 1
        for work, drafts in zip(cuttable, kept, strict=True):
            cut += len(work.rows) - 1 - drafts
            cut_to(work, 1 + drafts, device)
    return cut


def cut_to(work: Work, rows: int, device: torch.device) -> None:
    """The step's first `rows` rows alone."""
    if rows < len(work.rows):
        work.rows, work.reach = work.rows[:rows], work.reach[: rows - 1]
        work.step = Step.span(work.step.start, rows, device)
