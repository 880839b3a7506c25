"""Building an engine from its `EngineSetup`: the weights and tokenizer, the runner of decode
steps, the drafter, and the start-up cost table of the adaptive width.

`Engine` is what every request works with; it holds no per-request state (that is the session's
cache and the request's own stages).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.checkpoints.loading import load_model
from lucebox.device import DeviceClock
from lucebox.engine.batcher import StepBatcher
from lucebox.engine.runner import StepRunner
from lucebox.engine.setup import EngineSetup
from lucebox.kernels.backend import kernels_for
from lucebox.limits import DRAFT_WIDTH
from lucebox.memory.expert_cache import ExpertTraffic
from lucebox.models.decoder import Decoder
from lucebox.models.hf_config import token_ids
from lucebox.speculative.drafters import make_proposer
from lucebox.speculative.learned import Learned
from lucebox.speculative.proposer import Proposer
from lucebox.text.tokenizer import Tokenizer


@dataclass
class Engine:
    setup: EngineSetup
    decoder: Decoder
    runner: StepRunner
    tokenizer: Tokenizer | None
    proposer: Proposer | None
    expert_traffic: ExpertTraffic  # what the expert caches did, counted over every request
    clock: DeviceClock
    eos_token_ids: tuple[int, ...]
    learned: Learned | None = None  # what the adaptive width learns, shared by requests (None: fixed width)
    batcher: StepBatcher | None = None  # the steps of requests running at once, as one forward (`engine.batcher`)

    def __post_init__(self) -> None:
        if self.batcher is None:
            self.batcher = StepBatcher(lambda: self.runner,
                                       lambda: None if self.learned is None else self.learned.costs)

    def new_cache(self) -> SequenceCache:
        s = self.setup
        return SequenceCache(s.model, s.cache, s.dtype, s.device)

    def prefill(self, ids: list[int], cache: SequenceCache, proposer: Proposer | None = None,
                snapshots: Collection[int] = (), forward: Callable | None = None) -> Iterator[torch.Tensor]:
        """Forward ids[cache.length:] in chunks of `prefill_chunk` rows, committing each; yields
        each chunk's hidden states (T, H). A proposer is given every chunk (and its features).
        On a hybrid model a chunk also ends at each position of `snapshots`, whose recurrent states
        are pinned there (`SequenceCache.pin`) for later prompts sharing only that prefix.
        `forward`: what runs a chunk (`Decoder.forward_capturing`'s arguments; a request's: the
        batcher's, so the chunk takes its turn among other requests' steps)."""
        forward = forward or self.decoder.forward_capturing
        device = self.setup.device
        all_ids = torch.tensor(ids, device=device)
        layers = proposer.feature_layers if proposer is not None else ()
        pins = set(snapshots) if cache.has_states else set()
        for begin, end in prefill_spans(cache.length, len(ids), self.setup.prefill_chunk, pins):
            step = Step.span(begin, end - begin, device, prefill=True)
            hidden, features = forward(all_ids[begin:end], step, cache, layers)
            cache.commit(end, choose=end == len(ids))  # KVFlash chooses once, when the prompt is in
            if end in pins:
                cache.pin(end)
            if proposer is not None:
                proposer.commit(ids[:end], end - begin, features)
            yield hidden

    @property
    def logits_dtype(self) -> torch.dtype:
        """Logits leave the engine in float32 at least (float64 models keep float64)."""
        dtype = self.setup.dtype
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def prefill_spans(start: int, stop: int, chunk: int, also_end_at: set[int]) -> list[tuple[int, int]]:
    """(begin, end) of each prefill chunk over [start, stop): `chunk` rows each, also ending at
    each position of `also_end_at` inside the range."""
    ends = sorted({*range(start + chunk, stop, chunk), stop} | {p for p in also_end_at if start < p < stop})
    return list(zip([start, *ends[:-1]], ends, strict=True)) if stop > start else []


def build_engine(setup: EngineSetup, load_progress: Callable[[int, int], None] | None = None) -> Engine:
    """Load the model the setup describes and everything that runs it (`load_progress(done, total)`
    in bytes of weights read)."""
    config, traffic = setup.config, ExpertTraffic()
    loaded = load_model(setup.description, setup.dtype, setup.device, config.load_format, kernels_for(setup.backend),
                        setup.quantization, load_progress, setup.expert_slots, traffic, setup.lm_head)
    runner = StepRunner(loaded.decoder, graphs=setup.cuda_graphs)
    proposer = make_proposer(setup.drafter, loaded.decoder, setup.cache.max_context, setup.prefill_chunk,
                             config.draft_ctx, DRAFT_WIDTH)
    if runner.graphs and proposer is not None:  # the drafter's pass shares the steps' pool
        proposer.graph_with(runner.capture, lambda: runner.pool)  # the pool of the steps' graphs when it captures
    eos = eos_ids(setup, loaded.tokenizer)
    return Engine(setup, loaded.decoder, runner, loaded.tokenizer, proposer, traffic, DeviceClock(setup.device), eos)


def eos_ids(setup: EngineSetup, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """Every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's."""
    ids = list(setup.model.eos_token_ids) + list(token_ids(setup.description.generation_config.get("eos_token_id")))
    if tokenizer is not None:
        ids += tokenizer.eos_token_ids
    return tuple(dict.fromkeys(ids))
