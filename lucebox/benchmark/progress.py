"""Progress of a benchmark: rich bars on a terminal (the rows, then each request's prefill and
decode), plain lines on stderr elsewhere (a file, CI, a test)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class LineProgress:
    """Without a terminal: one line per finished request and per finished row."""

    def start(self, line: str, rows: int) -> None:
        print(f"bench {line}", file=sys.stderr, flush=True)

    def row(self, depth: int, requests: int) -> None:
        pass

    def prefill(self, label: str, tokens: int) -> None:
        pass

    def decoding(self, tokens: int) -> None:
        pass

    def advance(self, tokens: int) -> None:
        pass

    def request_done(self, line: str) -> None:
        print(f"bench {line}", file=sys.stderr, flush=True)

    def row_done(self, line: str) -> None:
        print(f"bench {line}", file=sys.stderr, flush=True)


class BarProgress(LineProgress):
    """A bar over the rows, one over the current row's requests, and one for the current request:
    pulsing while the prompt is prefilled (the engine reports nothing until the first token), then
    counting decoded tokens."""

    def __init__(self, bar: Progress):
        self.bar = bar
        self.rows = bar.add_task("opening the engines", total=None)
        self.requests = bar.add_task("depth", total=1, visible=False)
        self.tokens = None  # the current request's task, made afresh for each (rich cannot unset a total)
        self.label = ""

    def start(self, line: str, rows: int) -> None:
        self.bar.console.print(line)
        self.bar.reset(self.rows, total=rows, description="rows")

    def row(self, depth: int, requests: int) -> None:
        self.bar.reset(self.requests, total=requests, description=f"depth {depth}", visible=True)

    def prefill(self, label: str, tokens: int) -> None:
        if self.tokens is not None:
            self.bar.remove_task(self.tokens)
        self.tokens = self.bar.add_task(f"{label}: prefill {tokens} tokens", total=None)
        self.label = label

    def decoding(self, tokens: int) -> None:
        self.bar.update(self.tokens, total=tokens, description=f"{self.label}: decode")

    def advance(self, tokens: int) -> None:
        self.bar.advance(self.tokens, tokens)

    def request_done(self, line: str) -> None:
        self.bar.advance(self.requests)

    def row_done(self, line: str) -> None:
        self.bar.console.print(line)
        self.bar.advance(self.rows)


@contextmanager
def bench_progress() -> Iterator[LineProgress]:
    console = Console(stderr=True)
    if not console.is_terminal:
        yield LineProgress()
        return
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        yield BarProgress(bar)
