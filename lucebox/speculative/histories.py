"""Each verify row's token history, for the penalties. Row i scores the token after the committed
tokens and the drafts on its path (a chain's row i: d1..di; a tree's row: the tokens of its
ancestors and its own), so its penalties count those drafts as plain decoding would once it had
committed them: the repetition penalty marks them seen, the presence and frequency penalties
count them as generated. Built only when a penalty reads them (no work in the default round)."""

from __future__ import annotations

import torch

from lucebox.sampling import SamplingParams


def _index(paths: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, path in enumerate(paths) for _ in path]
    tokens = [t for path in paths for t in path]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))


def mark_paths(seen: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """(T, V) bool: `seen` (V,) with row i also marking the tokens of paths[i]."""
    rows = seen.expand(len(paths), -1).clone()
    rows[_index(paths, seen.device)] = True
    return rows


def count_paths(counts: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """(T, V) float32: `counts` (V,) with row i also counting each token of paths[i] once more."""
    rows = counts.expand(len(paths), -1).clone()
    index = _index(paths, counts.device)
    rows.index_put_(index, torch.ones(index[0].shape[0], dtype=rows.dtype, device=rows.device), accumulate=True)
    return rows


def row_histories(seen: torch.Tensor, counts: torch.Tensor | None, paths: list[list[int]],
                  params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(seen, counts) for the rows of `paths`: (T, V) where a penalty of `params` reads them, else
    as given ((V,), broadcast over the rows)."""
    if params.repetition_penalty != 1.0:
        seen = mark_paths(seen, paths)
    if counts is not None and params.counts_generated:
        counts = count_paths(counts, paths)
    return seen, counts


def chain_paths(drafts: list[int]) -> list[list[int]]:
    """The paths of a chain's rows [last, d1..dk]: row i follows d1..di."""
    return [drafts[:i] for i in range(len(drafts) + 1)]
