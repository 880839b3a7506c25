"""The session: the sequence cache an engine keeps between requests, so that a prompt extending
the previous request's tokens prefills only its new ones.

Contract: `open(prompt_ids, private, speculate)` hands a request its cache (the session's, rolled
back to what the prompt shares with the tokens it holds, or a private one when another stream is
open) and its drafter, ready for the prompt; `keep(cache, tokens)` records, when the request
ends however it ends, the tokens whose rows the session's cache now holds. A cache left dirty by
an interrupted step is never reused (`SequenceCache.dirty`). CUDA graphs read the session's cache
by address, so it is emptied and reused rather than reallocated whenever it can be.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.engine.build import Engine
from lucebox.limits import DECODE_ROWS
from lucebox.speculative.proposer import Proposer
from lucebox.speculative.tree import chain


class Session:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.cache: SequenceCache | None = None
        self.tokens: list[int] = []  # ids whose rows `cache` holds (its first `cache.length` at least)
        # Whether the drafter has seen every row the session's cache holds (so `resume` can trust it).
        self.drafter_follows = False
        self.open_streams = 0  # streams begun and not finished; a second one gets a private cache
        # The figures (Chunk.stats) of the last request, also of one cut short after its first token
        # (what a chat's /stats shows after Ctrl-C); None while one runs, or when it was cut before.
        self.last_stats: dict | None = None

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
        self.cache, self.tokens = cache, []

    def capture_graphs(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture, on the session's cache, every step graph requests will replay: each width up to
        DECODE_ROWS with the drafter's feature layers (none without a DFlash drafter), plain
        decoding without them, each draft tree's width up to the tree budget (a tree graph serves
        every tree of its width: the shape comes in with the step's inputs), and the drafter's
        block pass; so no request waits for a capture or a Triton compile. `progress(done, total)`
        after each."""
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
        draft_graph = proposer.graph if proposer is not None else None
        total = len(keys) + (draft_graph is not None)
        for done, (width, captured, tree) in enumerate(keys, 1):
            engine.runner.step(rows[prefix : prefix + width], Step.span(prefix, width, device), cache, captured,
                               chain(rows[prefix], rows[prefix + 1 : prefix + width]) if tree else None)
            cache.rollback(prefix)
            if progress is not None:
                progress(done, total)
        if draft_graph is not None:  # over the drafter's empty rings: every slot masked, nothing kept
            draft_graph.pass_at(rows[0], 0)
            if progress is not None:
                progress(total, total)
        cache.rollback(0)
        cache.commit(0)  # the steps completed: clean, so the first request reuses it and the graphs over it
        self.cache, self.tokens = cache, []

    def open(self, prompt_ids: list[int], private: bool, speculate: bool = True
             ) -> tuple[SequenceCache, Proposer | None]:
        engine = self.engine
        cache = engine.new_cache() if private else self._reusable(prompt_ids)
        proposer = None if private or not speculate else engine.proposer  # a drafter serves one stream at a time
        if proposer is not None and not (self.drafter_follows and proposer.resume(cache.length)):
            if proposer.feature_layers:
                cache.rollback(0)  # the drafter needs target features of every row: prefill them again
            proposer.start(prompt_ids, None)
        if not private:
            self.cache, self.tokens = cache, list(prompt_ids[: cache.length])
            self.drafter_follows = proposer is not None
        return cache, proposer

    def keep(self, cache: SequenceCache, tokens: list[int]) -> None:
        """A request on the session's cache has ended: its rows are those of `tokens`."""
        if cache is self.cache:
            self.tokens = list(tokens[: cache.length])

    def drop(self) -> None:
        """Forget the cached conversation (freeing its cache and the graphs over it)."""
        self.cache, self.tokens = None, []
        self.engine.runner.release()

    def _reusable(self, prompt_ids: list[int]) -> SequenceCache:
        """The previous request's cache rolled back to the longest prefix it shares with this prompt
        and can return to exactly (a hybrid's recurrent states: a position whose state it kept), at
        least one prompt token being forwarded again for its logits; or emptied; a fresh cache when
        it was left dirty."""
        cache = self.cache
        if cache is not None:
            held = self.tokens[: cache.length]  # a request that failed midway committed only part of its ids
            shared = 0
            for a, b in zip(held, prompt_ids, strict=False):
                if a != b:
                    break
                shared += 1
            keep = cache.rewind_point(min(shared, len(prompt_ids) - 1))  # a hybrid's: a state it kept
            if keep > 0:
                cache.rollback(keep)
                return cache
        return self._clean()  # nothing shared: a clean cache's buffers (and the graphs over them) serve again

    def _clean(self) -> SequenceCache:
        """The session's cache emptied when it is clean (keeping the graphs captured over it), else a
        fresh one."""
        cache = self.cache
        if cache is not None and not cache.dirty:
            cache.rollback(0)
            return cache
        return self._fresh()

    def _fresh(self) -> SequenceCache:
        self.drop()  # the old cache (and the graphs over it) go before a new one is allocated
        cache = self.engine.new_cache()
        self.engine.runner.bind(cache)
        return cache
