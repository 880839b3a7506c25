"""Resumable training state: weights, optimizer, step, log (and anything else a loop needs), saved
atomically so an interrupted run resumes by being started again."""

from __future__ import annotations

from pathlib import Path

import torch


def save_state(path: Path, step: int, weights: dict, optimizer, log: list[dict], **extra) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "weights": {n: w.detach() for n, w in weights.items()},
                "optimizer": optimizer.state_dict(), "log": log, **extra}, tmp)
    tmp.replace(path)  # never a half-written state


def load_state(path: Path, weights: dict, optimizer) -> tuple[int, list[dict], dict]:
    """Restore `weights` (in place) and `optimizer` from `path` if it exists: (step, log, the state)."""
    if not path.is_file():
        return 0, [], {}
    state = torch.load(path, weights_only=True)
    with torch.no_grad():
        for n, w in state["weights"].items():
            weights[n].copy_(w)
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["log"], state
