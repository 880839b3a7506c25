"""One engine, `parallel` streams at a time (`lucebox serve --parallel`, `EngineConfig.parallel`):
requests wait in a bounded FIFO queue and each of `parallel` worker threads runs one to completion
(or to its cancellation, checked at every chunk), off the event loop, so the server answers
/health and /metrics during a long generation. The requests running at once share each step's
forward (`engine.batcher`); with `--parallel 1` one runs at a time, as before there were slots."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from contextlib import closing
from dataclasses import dataclass, field

import torch

from lucebox.request_options import RequestOptions
from lucebox.server.choices import choice_options
from lucebox.server.openai_api import APIError

_END = object()


@dataclass(eq=False)  # a job is itself: kept in the set of running ones by identity
class Job:
    """A request for the worker; its events (chunks, then an exception or the end) reach the event
    loop through `events`."""

    prompt_ids: list[int]
    options: RequestOptions  # what LLM.stream runs on prompt_ids
    loop: asyncio.AbstractEventLoop
    n: int = 1  # choices, run one after another (`server.choices`)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: threading.Event = field(default_factory=threading.Event)  # the server stopping: it ends with a 503
    submitted: float = field(default_factory=time.perf_counter)

    def send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
            self.cancelled.set()

    async def next(self):
        """The next chunk, or None at the end; an error the worker met is raised here."""
        item = await self.events.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class SlotMetrics:
    """One worker thread's figures (a slot of the engine: one request at a time)."""

    requests: int = 0
    busy: bool = False
    last_decode_tokens_per_s: float = 0.0
    last_acceptance_length: float = 0.0
    last_cached_prompt_tokens: int = 0


@dataclass
class Metrics:
    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    last_decode_tokens_per_s: float = 0.0
    last_prefill_tokens_per_s: float = 0.0
    last_acceptance_length: float = 0.0
    memory: dict = field(default_factory=dict)
    slots: list[SlotMetrics] = field(default_factory=list)


class EngineWorker:
    def __init__(self, llm, max_queue: int):
        self.llm, self.max_queue = llm, max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: set[Job] = set()
        self.stopping = False
        parallel = llm.engine_config.parallel
        self.metrics = Metrics(memory=llm.memory(), slots=[SlotMetrics() for _ in range(parallel)])
        self._lock = threading.Lock()  # submit vs stop, and the set of running jobs
        self._threads = [threading.Thread(target=self._run, args=(slot,), name=f"lucebox-engine-{slot}", daemon=True)
                         for slot in range(parallel)]
        for thread in self._threads:
            thread.start()

    @property
    def waiting(self) -> int:
        """Requests in the queue whose clients still wait for them."""
        return sum(1 for job in list(self.jobs.queue) if job is not None and not job.cancelled.is_set())

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return self.waiting + len(self.running)

    @property
    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.stopping:
                raise APIError(503, "the server is shutting down")
            if self.waiting >= self.max_queue:
                per_job = self.metrics.busy_seconds / max(self.metrics.requests, 1)
                wait = max(1, round(per_job * self.depth / len(self._threads)))
                raise APIError(429, f"{self.depth} requests are ahead (the queue holds {self.max_queue}); "
                                    f"retry in about {wait} s", headers={"Retry-After": str(wait)})
            self.jobs.put(job)

    def begin_stop(self) -> None:
        """Refuse new requests and answer the waiting ones 503; the running one may finish."""
        with self._lock:
            self.stopping = True
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.send(APIError(503, "the server is shutting down"))
                    job.send(_END)

    def abort_running(self) -> None:
        """The running requests end at their next token with 503 (the server is stopping and its time
        for them is up): their clients get an answer before the connections are cut."""
        with self._lock:
            for job in self.running:
                job.aborted.set()
                job.cancelled.set()

    def stop(self, timeout: float = 10.0) -> None:
        """`begin_stop`, cancel the running request at its next token, and wait for the worker."""
        self.begin_stop()
        with self._lock:
            for job in self.running:
                job.cancelled.set()
            for _ in self._threads:
                self.jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))

    def _run(self, slot: int) -> None:
        if self.llm.device.type == "cuda":
            torch.cuda.set_device(self.llm.device)  # per thread: Triton launches and CUDA graphs follow it
        mine = self.metrics.slots[slot]
        while True:
            job = self.jobs.get()
            if job is None:
                return
            with self._lock:  # under the lock `stop` cancels the running ones: none starts unseen
                refused, gone = self.stopping, job.cancelled.is_set()
                if not (refused or gone):
                    self.running.add(job)
            if refused or gone:
                if refused:
                    job.send(APIError(503, "the server is shutting down"))
                job.send(_END)
                continue
            mine.busy, started = True, time.perf_counter()
            try:
                self._generate(job, mine)
            except Exception as e:  # reaches the client as an error response; the worker goes on
                # (a cache a failed step left half-written is dirty: the engine never reuses it)
                with self._lock:
                    self.metrics.failed += 1
                job.send(e)
            finally:
                with self._lock:
                    self.metrics.busy_seconds += time.perf_counter() - started
                    self.metrics.requests += 1
                    self.running.discard(job)
                with contextlib.suppress(Exception):  # a figure for /metrics never stops the worker
                    self.metrics.memory = self.llm.memory()
                mine.busy = False
                mine.requests += 1
                job.send(_END)

    def _generate(self, job: Job, mine: SlotMetrics) -> None:
        for index in range(job.n):  # each choice reuses the prompt's rows the one before left cached
            with closing(self.llm.stream(job.prompt_ids, choice_options(job.options, index))) as chunks:
                for chunk in chunks:
                    job.send(chunk)
                    if chunk.stats is not None:
                        self._record(chunk.stats, mine)
                    if job.aborted.is_set():
                        raise APIError(503, "the server is shutting down")
                    if job.cancelled.is_set():  # the client left: stop between chunks, the engine stays consistent
                        with self._lock:
                            self.metrics.cancelled += 1
                        return

    def _record(self, stats: dict, mine: SlotMetrics) -> None:
        mine.last_decode_tokens_per_s = stats["decode_tokens_per_s"]
        mine.last_acceptance_length = stats.get("acceptance_length", 0.0)
        mine.last_cached_prompt_tokens = stats["cached_prompt_tokens"]
        with self._lock:
            self._add(stats)

    def _add(self, stats: dict) -> None:
        m = self.metrics
        m.prompt_tokens += stats["prompt_tokens"]
        m.cached_prompt_tokens += stats["cached_prompt_tokens"]
        m.generated_tokens += stats["generated_tokens"]
        m.last_decode_tokens_per_s = stats["decode_tokens_per_s"]
        m.last_prefill_tokens_per_s = stats["prefill_tokens_per_s"]
        m.last_acceptance_length = stats.get("acceptance_length", 0.0)


def slot_lines(slots: list[SlotMetrics]) -> list[str]:
    """/metrics lines of each slot, labelled slot="i" (Prometheus text)."""
    lines = []
    for name, kind, what, value in (
            ("slot_busy", "gauge", "1 while the slot runs a request", lambda s: int(s.busy)),
            ("slot_requests_total", "counter", "requests the slot ran", lambda s: s.requests),
            ("slot_decode_tokens_per_second", "gauge", "decode speed of the slot's last request",
             lambda s: s.last_decode_tokens_per_s),
            ("slot_acceptance_length", "gauge", "tokens per verify round, the slot's last request",
             lambda s: s.last_acceptance_length),
            ("slot_cached_prompt_tokens", "gauge", "prompt tokens the slot's last request found cached",
             lambda s: s.last_cached_prompt_tokens)):
        lines += [f"# HELP lucebox_{name} {what}", f"# TYPE lucebox_{name} {kind}"]
        lines += [f'lucebox_{name}{{slot="{i}"}} {value(slot)}' for i, slot in enumerate(slots)]
    return lines
