"""One request, start to end: the same loop for plain and speculative decoding.

Three stages, each with a contract docstring: the runner (`engine.runner`, one target step of
any width), the speculation stage (`speculative.rounds`: draft, verify, commit; k = 0 without a
drafter) and the text stage (`engine.text_stage`: detokenize, stop strings and ids,
`max_tokens`). The prompt is prefilled in chunks (reusing the session's prefix), its last logits
choose the first token, then each round's new tokens go through the text stage before the cache
commits them, so a stop inside a round commits nothing past it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lucebox.constrained import GrammarState
from lucebox.engine.build import Engine
from lucebox.engine.session import Session
from lucebox.engine.text_stage import TextStage, timing_stats
from lucebox.generation import Chunk
from lucebox.sampling import SamplingParams
from lucebox.speculative.rounds import DecodeContext, Speculation


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_strings: list[str]
    stop_ids: set[int]
    speculate: bool  # False: this request leaves the engine's drafter out
    draft_k: int  # most drafts per round
    # Prompt positions (a chat's turn boundary) whose recurrent states a hybrid model keeps for a
    # later prompt that shares only that prefix; its second-to-last position is always kept.
    snapshots: tuple[int, ...] = ()
    grammar: GrammarState | None = None  # constrained output: this request's matcher
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest (`lucebox.logprobs`)


@torch.inference_mode()
def run_request(engine: Engine, session: Session, request: Request) -> Iterator[Chunk]:
    """Yield the request's chunks; the last carries finish_reason and stats. A second request
    started while one is still streaming gets a cache of its own."""
    private = session.open_streams > 0
    session.open_streams += 1
    try:
        yield from _decode(engine, session, request, private)
    finally:
        session.open_streams -= 1


def _decode(engine: Engine, session: Session, request: Request, private: bool) -> Iterator[Chunk]:
    prompt_ids = request.prompt_ids
    session.last_stats = stats = None
    cache, proposer = session.open(prompt_ids, private, request.speculate)
    reused = cache.length
    setup = engine.setup
    # Under a grammar a draft can end early (at a token the grammar forbids), which block verification
    # does not allow for: tokenwise verification stays exact with it (`constrained.state`).
    rule = "tokenwise" if request.grammar is not None and setup.config.verify == "block" else setup.config.verify
    context = DecodeContext(engine.runner, cache, engine.clock, engine.learned, request.draft_k,
                            rule, setup.config.adaptive, setup.model.vocab_size, setup.device,
                            setup.tree_budget)
    rounds = Speculation(context, request.params, proposer, prompt_ids, request.grammar, request.logprobs)
    text = TextStage(engine.tokenizer, prompt_ids, request.stop_strings, request.stop_ids, request.max_tokens)
    traffic = dataclasses.replace(engine.expert_traffic)  # this request's expert cache traffic is counted from here
    start, prefill_done = engine.clock(), None
    try:
        *_, hidden = engine.prefill(prompt_ids, cache, proposer, {*request.snapshots, len(prompt_ids) - 1})
        logits = engine.decoder.logits(hidden[-1:])
        first = rounds.first(logits)
        prefill_done = engine.clock()
        chunk = rounds.attach_logprobs(text.feed([first]), logits)
        while text.finish is None:
            yield chunk
            chunk = rounds.round(text.remaining, text.feed)
    finally:
        session.keep(cache, rounds.state.tokens)
        if prefill_done is not None:  # also when the request is cut short (its reader stopped, Ctrl-C)
            timing = timing_stats(len(prompt_ids), reused, len(text.generated), start, prefill_done, engine.clock())
            experts = engine.expert_traffic.since(traffic) if setup.expert_slots is not None else {}
            stats = session.last_stats = {**timing, **rounds.stats(), **experts}
    yield text.last(stats)
