"""The session: the sequence caches an engine keeps between requests, so that a prompt extending
an earlier request's tokens prefills only its new ones.

Contract: `open(prompt_ids, speculate)` hands a request a cache and its drafter, ready for
the prompt, from one of the engine's `slots` (`EngineConfig.parallel`): the free slot whose cache
returns exactly to the longest prefix of the prompt, else the free slot used least recently (a
conversation that comes back after others finds its rows while fewer than `parallel` others came
between; on a GPU a new conversation takes the first slot when it is free: only its steps replay
graphs); with no free slot, a cache and a drafter of its own. `keep(cache,
tokens)` records, when the request ends however it ends, the tokens whose rows that cache now
holds, and frees its slot. A cache left dirty by an interrupted step is never reused
(`SequenceCache.dirty`). CUDA graphs read the first slot's cache by address, so it is emptied
and reused rather than reallocated whenever it can be; the other slots' steps run eagerly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.engine.build import Engine
from lucebox.limits import DECODE_ROWS
from lucebox.speculative.proposer import Proposer
from lucebox.speculative.tree import chain


@dataclass
class Slot:
    """Room for one running request: its cache (made on first use) and drafter, and what they hold."""

    proposer: Proposer | None  # the engine's drafter in the first slot, a fork of it in the others
    cache: SequenceCache | None = None
    tokens: list[int] = field(default_factory=list)  # ids whose rows `cache` holds (its first `cache.length` at least)
    drafter_follows: bool = False  # whether the drafter has seen every row the cache holds (`resume` can trust it)
    busy: bool = False
    last_used: int = 0  # when a request last opened it (a count of opens)


class Session:
    def __init__(self, engine: Engine, slots: int = 1):
        self.engine = engine
        self.slots = [Slot(engine.proposer)] + [Slot(None) for _ in range(slots - 1)]  # drafters forked on first use
        self.open_streams = 0  # streams begun and not finished
        self._opens = 0
        self._lock = threading.Lock()  # requests open and keep slots from their own threads
        # The figures (Chunk.stats) of the last request, also of one cut short after its first token
        # (what a chat's /stats shows after Ctrl-C); None while one runs, or when it was cut before.
        self.last_stats: dict | None = None

    # The first slot's: the cache the graphs serve, which the engine warms and a single user reuses.
    cache = property(lambda self: self.slots[0].cache)
    tokens = property(lambda self: self.slots[0].tokens)
    drafter_follows = property(lambda self: any(slot.drafter_follows for slot in self.slots))

    def warm(self) -> None:
        """Measure the adaptive width's start-up cost table on the session's cache, with the feature
        layers requests capture (replaying the graphs `capture_graphs` left, or capturing them), and
        leave that cache clean for the first request."""
        from lucebox.speculative.drafters import measure_verify_seconds
        from lucebox.speculative.learned import Learned, read_calibration
        from lucebox.speculative.width import RoundCosts

        engine = self.engine
        cache = self._clean()
        layers = engine.proposer.feature_layers if engine.proposer is not None else ()
        costs = RoundCosts(measure_verify_seconds(engine.runner, cache, engine.clock, layers))
        drafter = engine.setup.drafter
        engine.learned = Learned(costs, read_calibration(None if drafter is None else drafter.folder))
        self.slots[0].cache, self.slots[0].tokens = cache, []

    def capture_graphs(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture, on the session's cache, every step graph requests will replay: each width up to
        DECODE_ROWS with the drafter's feature layers (none without a drafter that reads them), plain
        decoding without them, each draft tree's width up to the tree budget (a tree graph serves
        every tree of its width: the shape comes in with the step's inputs), and the drafter's
        pass (a DFlash block, an MTP head's row); so no request waits for a capture or a Triton
        compile. `progress(done, total)` after each. Run before any request (the caches it writes
        are made here, outside inference mode, and later steps write them in place outside it too)."""
        engine = self.engine
        proposer = engine.proposer
        layers = proposer.feature_layers if proposer is not None else ()
        room = engine.setup.cache.max_context
        prefix = min(8, max(room - DECODE_ROWS, 1))  # a real prefix before each step, and room for the widest
        widest = min(DECODE_ROWS, room - prefix)  # a request never steps wider than its context
        trees = engine.setup.tree_budget if proposer is not None and proposer.drafts_trees else 0
        keys = ([(width, layers, False) for width in range(widest, 0, -1)]
                + ([(1, (), False)] if layers and widest else [])
                + [(width, layers, True) for width in range(min(trees + 1, widest), 1, -1)])
        # Widest first: the shared pool grows once, and the narrower graphs reuse its blocks.
        cache = self._clean()
        device, vocab = engine.decoder.device, engine.decoder.cfg.vocab_size
        rows = [(i * 7919) % vocab for i in range(prefix + widest)]  # distinct: MoE rows spread as real ones do
        engine.decoder.forward(torch.tensor(rows[:prefix], device=device), Step.span(0, prefix, device, prefill=True),
                               cache)
        cache.commit(prefix)
        graphs_draft = proposer is not None and proposer.graph is not None
        total = len(keys) + graphs_draft
        for done, (width, captured, tree) in enumerate(keys, 1):
            engine.runner.step(rows[prefix : prefix + width], Step.span(prefix, width, device), cache, captured,
                               chain(rows[prefix], rows[prefix + 1 : prefix + width]) if tree else None)
            cache.rollback(prefix)
            if progress is not None:
                progress(done, total)
        if graphs_draft:  # over the drafter's empty rings: every slot masked, nothing kept
            proposer.capture_graph(rows[0])
            if progress is not None:
                progress(total, total)
        cache.rollback(0)
        cache.commit(0)  # the steps completed: clean, so the first request reuses it and the graphs over it
        self.slots[0].cache, self.slots[0].tokens = cache, []

    def open(self, prompt_ids: list[int], speculate: bool = True) -> tuple[SequenceCache, Proposer | None]:
        engine = self.engine
        with self._lock:
            self.open_streams += 1
            slot, keep = self._choose(prompt_ids)
            if slot is not None:
                slot.busy, self._opens = True, self._opens + 1
                slot.last_used = self._opens
        if slot is None:
            return self._private(prompt_ids, speculate)
        try:
            cache = self._reusable(slot, keep)
            if slot is self.slots[0] and engine.runner.bound is not cache:  # (changed only in `exclusive`)
                with engine.batcher.exclusive():  # the graphs serve the first slot
                    engine.runner.bind(cache)
            if slot.proposer is None and slot is not self.slots[0] and engine.proposer is not None:
                slot.proposer = engine.proposer.fork()
            proposer = slot.proposer if speculate else None
            if proposer is not None and not (slot.drafter_follows and proposer.resume(cache.length)):
                if proposer.feature_layers:
                    cache.rollback(0)  # the drafter needs target features of every row: prefill them again
                self._start(proposer, prompt_ids)
            slot.cache, slot.tokens = cache, list(prompt_ids[: cache.length])
            slot.drafter_follows = proposer is not None
        except BaseException:
            self._free(slot)
            raise
        return cache, proposer

    def _private(self, prompt_ids: list[int], speculate: bool) -> tuple[SequenceCache, Proposer | None]:
        """A cache and a fork of the drafter of its own (every slot is busy): the same
        output as in a slot, in memory the plan does not count."""
        engine = self.engine
        try:
            proposer = engine.proposer.fork() if speculate and engine.proposer is not None else None
            if proposer is not None:
                self._start(proposer, prompt_ids)
            return engine.new_cache(), proposer
        except BaseException:
            self._free(None)
            raise

    def _start(self, proposer: Proposer, prompt_ids: list[int]) -> None:
        """The drafter starts on the prompt (a draft model prefills it) aside from the batch: the
        others' turns go on meanwhile. The rest of `open` is short and counts as working, so a turn
        about to run waits for a request that is opening and takes its prompt's first chunk too."""
        with self.engine.batcher.aside():
            proposer.start(prompt_ids, None)

    def keep(self, cache: SequenceCache, tokens: list[int]) -> None:
        """A request opened with `cache` has ended: its rows are those of `tokens`; its slot is free."""
        slot = next((slot for slot in self.slots if slot.cache is cache and slot.busy), None)
        if slot is not None:
            slot.tokens = list(tokens[: cache.length])
        self._free(slot)

    def _free(self, slot: Slot | None) -> None:
        with self._lock:
            self.open_streams -= 1
            if slot is not None:
                slot.busy = False

    def drop(self) -> None:
        """Forget the cached conversations of the free slots (freeing their caches, and the graphs
        over the first slot's)."""
        runner = self.engine.runner
        with self._lock, self.engine.batcher.exclusive():
            for slot in self.slots:
                if not slot.busy:
                    if slot.cache is not None and runner.bound is slot.cache:  # the graphs over it go too
                        runner.release()
                    slot.cache, slot.tokens, slot.drafter_follows = None, [], False

    def _choose(self, prompt_ids: list[int]) -> tuple[Slot | None, int]:
        """The free slot whose cache the prompt continues (returning to at least half of what it
        holds) to the longest prefix, else the free slot used least recently, with the prefix it
        returns to; (None, 0) when every slot is busy. A prompt sharing only a little with a slot (a common
        first line) leaves it to the conversation it holds."""
        free = [slot for slot in self.slots if not slot.busy]
        if not free:
            return None, 0
        shared = {id(slot): self._returns_to(slot, prompt_ids) for slot in free}
        continued = [slot for slot in free if 0 < shared[id(slot)] and 2 * shared[id(slot)] >= slot.cache.length]
        if continued:
            slot = max(continued, key=lambda slot: (shared[id(slot)], -slot.last_used))
        elif self.engine.runner.capture and not self.slots[0].busy:
            slot = self.slots[0]  # on a GPU its steps replay graphs, the others' run eagerly: it wins
        else:
            slot = min(free, key=lambda slot: slot.last_used)
        return slot, shared[id(slot)]  # what the chosen slot shares is reused, however little

    @staticmethod
    def _returns_to(slot: Slot, prompt_ids: list[int]) -> int:
        """The longest prefix of the prompt `slot`'s cache can return to exactly, at least one prompt
        token being forwarded again for its logits (a hybrid's: a position whose state it kept)."""
        cache = slot.cache
        if cache is None:
            return 0
        shared = 0
        for a, b in zip(slot.tokens[: cache.length], prompt_ids, strict=False):  # a failed request committed part
            if a != b:
                break
            shared += 1
        return cache.rewind_point(min(shared, len(prompt_ids) - 1))

    def _reusable(self, slot: Slot, keep: int) -> SequenceCache:
        """The slot's cache rolled back to `keep`, the prefix `_choose` found it returns to; or emptied
        (keep 0); a fresh cache when it was left dirty."""
        if keep > 0:
            slot.cache.rollback(keep)
            return slot.cache
        return self._clean(slot)  # nothing shared: a clean cache's buffers (and the graphs over them) serve again

    def _clean(self, slot: Slot | None = None) -> SequenceCache:
        """The slot's (the first's by default) cache emptied when it is clean (keeping the graphs
        captured over it), else a fresh one."""
        slot = slot or self.slots[0]
        cache = slot.cache
        if cache is not None and not cache.dirty:
            cache.rollback(0)
            return cache
        return self._fresh(slot)

    def _fresh(self, slot: Slot) -> SequenceCache:
        old, runner = slot.cache, self.engine.runner
        slot.cache, slot.tokens, slot.drafter_follows = None, [], False  # the old cache goes before a new one is made
        first = slot is self.slots[0]
        if not first and (old is None or runner.bound is not old):
            return self.engine.new_cache()
        with self.engine.batcher.exclusive():
            runner.release()  # and the graphs over the old cache
            cache = self.engine.new_cache()
            if first:
                runner.bind(cache)
        return cache
