"""Progress of a training loop: a rich bar on a terminal, plain log lines elsewhere (a file, CI)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _figures(record: dict) -> str:
    return "  ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in record.items() if k not in ("step", "lr"))


@contextmanager
def training_progress(title: str, steps: int, every: int = 10):
    """Yields `on_step(step, record)`, which moves the bar and shows the record's figures (without a
    terminal: prints a line every `every` steps and whenever held-out figures arrive)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        def on_line(step: int, record: dict) -> None:
            if step % every == 0 or step == steps or any(k.startswith("held_out") for k in record):
                print(f"{title} {step}/{steps}  {_figures(record)}", file=sys.stderr, flush=True)

        yield on_line
        return
    columns = (TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[figures]}"))
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(title, total=steps, figures="")
        shown: dict = {}

        def on_step(step: int, record: dict) -> None:
            shown.update(record)
            bar.update(task, completed=step, figures=_figures(shown))

        yield on_step
