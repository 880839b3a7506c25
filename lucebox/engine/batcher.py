"""Many requests, one forward per step: the steps that requests running at the same time ask for
are gathered and run as one forward over all their rows.

Contract: every request runs in its own thread, its whole path unchanged (speculation, text,
grammar), inside `StepBatcher.track` while it works; its target steps go through `step` (the
`StepRunner.step` signature) and its prefill chunks through `forward`. A step waits until every
request that is working has asked for its own (or left: a request whose reader has not asked for
its next chunk is not working and keeps no one waiting), then one thread runs them all:

- decode/verify steps, and prefill chunks of at most `row_budget` rows (a short prompt's), with the
  same feature layers as one forward of at most `row_budget` rows
  (`models.cache_contexts.SequencesContext`: each sequence attends over its own cache and keeps
  its own recurrent state, everything else reads each weight once for all the rows); more rows
  go in the next forward of the same turn;
- longer prefill chunks one at a time, after the steps (each is a forward of its own rows, as alone).

A row's result never depends on the other rows of its forward where the kernels give a row the
same bits at every row count (the GPU's, rows padded to `DECODE_ROWS`; on the CPU the LM head
and routed experts, `tests/test_cpu_rows.py`); `row_budget` is `DECODE_ROWS` so that a
batch's rows take the decode kernels a step alone takes. One request working alone takes the
runner's own path (its CUDA graphs): one client runs as it did without batching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.engine.runner import StepOutput, StepRunner, eager_context, step_context
from lucebox.engine.turn_rows import allot
from lucebox.limits import DECODE_ROWS
from lucebox.models.cache_contexts import SequencesContext
from lucebox.speculative.width import RoundCosts


@dataclass(eq=False)  # a work is itself: found in the queue by identity (its rows may be a tensor)
class Work:
    """One request's ask: a target step (`rows`: token ids, a list or a tensor), a short prefill chunk
    (`rows` with `hidden`: it wants hidden states and features, not logits), or a forward run alone
    (`alone`: a longer prefill chunk)."""

    rows: list[int] | torch.Tensor | None = None
    step: Step | None = None
    cache: SequenceCache | None = None
    layers: tuple[int, ...] = ()
    tree: object | None = None
    alone: Callable[[], object] | None = None
    hidden: bool = False
    reach: list[float] | None = None  # a chain's drafts' chances of being kept, to cut by (`turn_rows.allot`)
    thread: threading.Thread = field(default_factory=threading.current_thread)  # the asking thread
    asked_at: float = field(default_factory=time.perf_counter)
    result: object = None
    error: BaseException | None = None
    done: bool = False


class StepBatcher:
    def __init__(self, runner: Callable[[], StepRunner], costs: Callable[[], RoundCosts | None] = lambda: None,
                 row_budget: int = DECODE_ROWS):
        self._runner, self.row_budget = runner, row_budget  # the engine's runner when a step runs (tests swap it)
        self._costs = costs  # the step costs adaptive widths learn (`Engine.learned`), which price a batch's drafts
        self._turn = threading.Condition()
        self._working = 0  # requests whose threads are in the engine now
        self._asked: list[Work] = []
        self._running = False  # a thread is running a turn's forwards
        self.forwards = 0  # forwards of several sequences' steps (for tests and /metrics)
        self.drafts_cut = 0  # draft rows batched steps left out (`turn_rows.allot`), for tests and /metrics
        self._threads_before: int | None = None  # torch's threads before requests' threads took one each

    @property
    def runner(self) -> StepRunner:
        return self._runner()

    @property
    def decoder(self):
        return self._runner().decoder

    @contextmanager
    def working(self):
        """A request's thread is in the engine: its steps are awaited by the others'."""
        self._settle_thread()
        with self._turn:
            self._working += 1
        try:
            yield
        finally:
            with self._turn:
                self._working -= 1
                if self._working == 0 and self._threads_before is not None:
                    torch.set_num_threads(self._threads_before)
                    self._threads_before = None
                self._turn.notify_all()  # those waiting may have been waiting only for this one

    @contextmanager
    def aside(self):
        """A working request's thread does work of its own (a drafter prefilling the prompt): the
        others' turns go on without waiting for its step meanwhile."""
        with self._turn:
            self._working -= 1
            self._turn.notify_all()
        try:
            yield
        finally:
            with self._turn:
                self._working += 1

    @contextmanager
    def exclusive(self):
        """No turn runs while this holds: what the runner's graphs read may change (a cache bound or
        released). Called by a working thread that has not asked, so no turn waits for it."""
        taken = False
        try:
            with self._turn:
                while self._running:
                    self._turn.wait()
                self._running = taken = True
            yield
        finally:
            if taken:
                with self._turn:
                    self._running = False
                    self._turn.notify_all()

    def _settle_thread(self) -> None:
        """A request's thread set for the engine's device. On CUDA, the engine's card is the thread's
        current device (Triton launches follow it). On the CPU, a small model's requests run torch
        on one thread each while they work from threads other than the main one (until none
        works): there libgomp's parallel regions cost about three times what they cost on the main
        thread (a 4-row step of the built-in model: 16-18 ms against 8-9 ms; 8.4 ms on one thread),
        more than two cores win on ops this small."""
        device = self.decoder.device
        if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
            torch.cuda.set_device(device)
        small = device.type == "cpu" and self.decoder.cfg.hidden_size <= SMALL_CPU_MODEL_HIDDEN
        if small and threading.current_thread() is not threading.main_thread() and torch.get_num_threads() != 1:
            if self._threads_before is None:
                self._threads_before = torch.get_num_threads()
            torch.set_num_threads(1)

    def track(self, chunks: Iterator) -> Iterator:
        """`chunks` (a request's generator) marked working while it runs, not while its reader holds a chunk."""
        try:
            while True:
                with self.working():
                    chunk = next(chunks, _END)
                if chunk is _END:
                    return
                yield chunk
        finally:
            with self.working():
                chunks.close()

    def row_share(self) -> int:
        """A working request's share of a forward's rows (at least 1): its round drafts at most
        one fewer, so the steps of everyone working fit one forward."""
        return max(1, self.row_budget // max(1, self._working))

    def step(self, rows: list[int], step: Step, cache: SequenceCache, layers: tuple[int, ...] = (),
             tree=None, reach: list[float] | None = None) -> StepOutput:
        """`StepRunner.step`, run with the steps other working requests ask for at the same time.
        With `reach` (each draft's chance of being kept along with those before it, rows being
        [last, d1..dk]), the step may run fewer rows, [last, d1..dj]: its output then has j + 1
        rows: the drafts of every request that pay for their rows, likeliest first, fill the
        forward (`turn_rows.allot`)."""
        return self._ask(Work(rows, step, cache, layers, tree, reach=reach))

    def forward(self, ids: torch.Tensor, step: Step, cache: SequenceCache,
                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`Decoder.forward_capturing` (a prefill chunk), run in its turn among the others' steps:
        beside them when it is as short as a step, else alone."""
        if len(ids) <= self.row_budget:
            return self._ask(Work(ids, step, cache, layers, hidden=True))
        return self._ask(Work(alone=lambda: self.decoder.forward_capturing(ids, step, cache, layers)))

    def _ask(self, work: Work):
        with self._turn:
            self._asked.append(work)
            self._turn.notify_all()
            try:
                while not work.done:
                    if not self._running and len(self._asked) >= self._working:  # nobody else is about to ask
                        self._run_turn()
                    else:
                        self._turn.wait()
            except BaseException:  # interrupted while waiting: a step not yet taken never runs, and
                if any(w is work for w in self._asked):  # one being run is waited for: the caller then
                    self._asked.remove(work)  # frees its cache's slot, which nothing may write after
                else:
                    self._wait_done(work)
                raise
        if work.error is not None:
            raise work.error
        return work.result

    def _wait_done(self, work: Work) -> None:
        """Wait (holding the lock) until another thread's turn has run `work`, whatever interrupts."""
        while not work.done:
            try:
                self._turn.wait()
            except BaseException:  # noqa: BLE001 - the first interrupt is raised by the caller
                continue

    def _run_turn(self) -> None:
        """Run everything asked so far, outside the lock (called holding it). Every work taken ends
        done, with its result or an error, however the turn ends."""
        asked, self._asked, self._running = self._asked, [], True
        try:
            self._turn.release()
            try:
                steps = [w for w in asked if w.alone is None]
                costs = self._costs()
                groups, cut = allot(steps, self.row_budget, self.decoder.device, None if costs is None else costs.step)
                self.drafts_cut += cut
                for group in groups:
                    self._settle(group, self._steps)
                for work in asked:
                    if work.alone is not None:
                        self._settle([work], lambda works: [works[0].alone()])
            finally:
                self._turn.acquire()
        finally:
            for work in asked:
                if not work.done:
                    work.error, work.done = RuntimeError("the step's turn was interrupted"), True
            self._running = False
            self._turn.notify_all()

    def _settle(self, works: list[Work], run: Callable[[list[Work]], list]) -> None:
        """Each work's result from `run(works)`. When a forward of several fails, each runs again
        alone, so one request's refusal (its cache's) is its own: a step writes its rows at fixed
        positions and commits nothing, so running it again is running it. An interrupt
        (KeyboardInterrupt) is the turn's thread's own: the others fail plainly."""
        started = time.perf_counter()
        try:
            for work, result in zip(works, run(works), strict=True):
                if isinstance(result, StepOutput):  # the time it waited for its forward was others'
                    result.waited_s = started - work.asked_at
                work.result, work.done = result, True
        except Exception as e:
            if len(works) > 1:
                for work in works:
                    self._settle([work], run)
                return
            works[0].error, works[0].done = e, True
        except BaseException as e:
            for work in works:
                work.error, work.done = (e if threading.current_thread() is work.thread
                                         else RuntimeError(f"the step's forward was interrupted ({e!r})")), True
            raise

    def _steps(self, works: list[Work]) -> list:
        """Each work's StepOutput (a prefill chunk's: hidden states and features), from one forward."""
        d, runner = self.decoder, self.runner
        if len(works) == 1:
            w = works[0]
            if w.hidden:
                return [d.forward_capturing(w.rows, w.step, w.cache, w.layers)]
            return [runner.step(w.rows, w.step, w.cache, w.layers, w.tree)]
        self.forwards += 1
        ids = torch.cat([torch.as_tensor(w.rows, dtype=torch.long, device=d.device) for w in works])
        # A step's attention over what a step alone reads: the cache's static block where graphs run
        # (the graph's store and gate come as separate ops here, not fused), else eager blocks.
        context_of = step_context if runner.graphs else eager_context
        parts = [eager_context(d, w.step, w.cache) if w.hidden else context_of(d, w.step, w.cache, w.tree)
                 for w in works]
        context = SequencesContext(parts, [len(w.rows) for w in works])
        hidden, features = d.run(ids, context, works[0].layers)
        stepped = [rows for w, rows in zip(works, context.spans, strict=True) if not w.hidden]
        logits = d.logits(torch.cat([hidden[rows] for rows in stepped])) if stepped else None
        outputs, at = [], 0
        for w, rows in zip(works, context.spans, strict=True):
            mine = None if features is None else features[rows]
            if w.hidden:
                outputs.append((hidden[rows], mine))
                continue
            # each sequence's choices alone: a non-finite logit spoils only its own
            own = logits[at : at + len(w.rows)]
            at += len(w.rows)
            outputs.append(StepOutput(own, d.kernels.greedy_choices(own), mine, len(ids)))
        return outputs


_END = object()
# Models this narrow run their requests' threads on one CPU thread (`StepBatcher._settle_thread`).
SMALL_CPU_MODEL_HIDDEN = 512
