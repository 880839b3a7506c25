"""argparse types for the numeric flags of `lucebox train` and `lucebox distill`: a value out of
range stops the command while its flags are parsed (argparse's one error line, exit code 2),
before a model is loaded or a folder made, instead of as a torch error minutes later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from lucebox.arguments import SEED_MAX

THREADS_MAX = 1024


def _integer_text(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in low..high (`high` None: no upper bound)."""
    def parse(text: str) -> int:
        value = _integer_text(text)
        if value < low or (high is not None and value > high):
            bounds = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value
    return parse


def learning_rate(text: str) -> float:
    """An argparse type: a finite learning rate in (0, 1] (AdamW diverges far below 1 already)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def layer_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated decoder layer indices (each checked against the target once
    it is read)."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, e.g. 1,4,6, got {text!r}") from None
    if min(layers) < 0:
        raise argparse.ArgumentTypeError(f"layer indices are 0 or more, got {text}")
    return layers


seed = integer(0, SEED_MAX)
threads = integer(1, THREADS_MAX)
