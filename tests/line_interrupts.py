"""Interrupts injected at one line of lucebox/caches/*.py (a sys.settrace hook raising
KeyboardInterrupt just before the n-th execution of that line, as a Ctrl-C arriving there
would), and the three-request scenario the engine must survive them in."""

import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

import lucebox

CACHES = str(Path(lucebox.caches.__file__).parent)
Line = tuple[str, int]  # (file, line number)
Request = tuple[list[int], dict]  # prompt ids, generate() options


class LineTrace:
    """Counts executions of each line of lucebox/caches/*.py; raises KeyboardInterrupt just before
    the `nth` execution of `target`."""

    def __init__(self, target: Line | None = None, nth: int = 0):
        self.counts: Counter[Line] = Counter()
        self.target, self.nth = target, nth

    def __call__(self, frame, event, arg):  # the global hook: trace only the cache code's frames
        return self._line if frame.f_code.co_filename.startswith(CACHES) else None

    def _line(self, frame, event, arg):
        if event == "line":
            line = (frame.f_code.co_filename, frame.f_lineno)
            self.counts[line] += 1
            if line == self.target and self.counts[line] == self.nth:
                raise KeyboardInterrupt(f"injected at {where(line, self.nth)}")
        return self._line


@contextmanager
def traced(trace: LineTrace):
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield trace
    finally:
        sys.settrace(previous)


def where(line: Line, nth: int) -> str:
    return f"{Path(line[0]).name}:{line[1]} (execution {nth})"


class Scenario:
    """Request 1 completes; request 2 reuses its cache and is interrupted; request 3 extends
    request 2's prompt and must give a fresh engine's tokens."""

    def __init__(self, folder: Path, engine: dict, first: Request, second: Request, third: Request):
        self.folder, self.engine = folder, engine
        self.first, self.second, self.third = first, second, third
        llm = self.after_first_request()
        with traced(LineTrace()) as trace:
            self.run(llm, second)
        self.counts = trace.counts  # every cache line request 2 runs, and how often
        self.expected = self.run(lucebox.LLM(folder, **engine), third)

    @staticmethod
    def run(llm: lucebox.LLM, request: Request) -> list[int]:
        ids, options = request
        return llm.generate(ids, ignore_eos=True, **options).token_ids

    def after_first_request(self) -> lucebox.LLM:
        llm = lucebox.LLM(self.folder, **self.engine)
        self.run(llm, self.first)
        return llm

    def check(self, line: Line, nth: int) -> str | None:
        """What went wrong after an interrupt at the nth execution of `line`, or None."""
        llm = self.after_first_request()
        with pytest.raises(KeyboardInterrupt), traced(LineTrace(line, nth)):
            self.run(llm, self.second)
        try:
            got = self.run(llm, self.third)
        except Exception as error:  # noqa: BLE001 - a KeyError here is one of the failures looked for
            return f"{where(line, nth)}: {error!r}"
        if got != self.expected:
            return f"{where(line, nth)}: {got} != {self.expected}"
        wrong = self.kept_state_error(llm)
        return None if wrong is None else f"{where(line, nth)}: {wrong}"

    def kept_state_error(self, llm: lucebox.LLM) -> str | None:
        """What is wrong with state the engine keeps for later requests (none checked here)."""
        return None
