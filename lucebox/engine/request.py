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
from lucebox.request_options import RequestOptions
from lucebox.speculative.rounds import DecodeContext, Speculation


@dataclass(frozen=True)
class Request:
    """A request as the engine runs it: `options` checked against the model and the prompt (`LLM.stream`)."""

    prompt_ids: list[int]
    options: RequestOptions
    stop_ids: set[int]  # the options' stop ids and, unless they ignore EOS, the model's EOS ids
    draft_k: int  # most drafts per round
    grammar: GrammarState | None = None  # the options' constraint: this request's matcher
    thought_close: GrammarState | None = None  # with a thought budget: the close, forced once it is spent


def run_request(engine: Engine, session: Session, request: Request) -> Iterator[Chunk]:
    """Yield the request's chunks; the last carries finish_reason and stats. Requests running at
    the same time (each read from its own thread) share each step's forward (`engine.batcher`);
    each gets a slot of the session (`Session.open`), or a cache of its own when all are busy."""
    return engine.batcher.track(_decode(engine, session, request))


@torch.inference_mode()
def _decode(engine: Engine, session: Session, request: Request) -> Iterator[Chunk]:
    prompt_ids, options = request.prompt_ids, request.options
    session.last_stats = stats = None
    rounds, prefill_done, cache = None, None, None
    try:
        cache, proposer = session.open(prompt_ids, options.speculate)
        start, reused = engine.clock(), cache.length
        setup = engine.setup
        # Under a grammar a draft can end early (at a token the grammar forbids), which block verification
        # does not allow for: tokenwise verification stays exact with it (`constrained.state`).
        constrained = request.grammar is not None or request.thought_close is not None
        rule = "tokenwise" if constrained and setup.config.verify == "block" else setup.config.verify
        context = DecodeContext(engine.batcher, cache, engine.clock, engine.learned, request.draft_k,
                                rule, setup.config.adaptive, setup.model.vocab_size, setup.device,
                                setup.tree_budget)
        rounds = Speculation(context, options.sampling, proposer, prompt_ids, request.grammar, options.logprobs)
        text = TextStage(engine.tokenizer, prompt_ids, list(options.stop_strings), request.stop_ids,
                         options.max_tokens, options.end_on_repeated_call,
                         (options.thought_syntax, options.starts_in_thought), options.thought_budget)
        traffic = dataclasses.replace(engine.expert_traffic)  # this request's expert cache traffic is counted from here
        *_, hidden = engine.prefill(prompt_ids, cache, proposer, {*options.snapshot_at, len(prompt_ids) - 1},
                                    engine.batcher.forward)
        logits = engine.decoder.logits(hidden[-1:])
        first = rounds.first(logits)
        prefill_done = engine.clock()
        chunk = rounds.attach_logprobs(text.feed([first]), logits)
        closing = request.thought_close
        while text.finish is None:
            yield chunk
            if closing is not None and text.thought.spent:  # the budget is spent: the close is forced now
                rounds.grammar, closing = closing, None
            chunk = rounds.round(text.remaining, text.feed)
    finally:
        if cache is not None:  # opened: its slot is freed, whatever happened since
            session.keep(cache, rounds.state.tokens if rounds is not None else prompt_ids[: cache.length])
        if prefill_done is not None:  # also when the request is cut short (its reader stopped, Ctrl-C)
            timing = timing_stats(len(prompt_ids), reused, len(text.generated), start, prefill_done, engine.clock())
            experts = engine.expert_traffic.since(traffic) if setup.expert_slots is not None else {}
            stats = session.last_stats = {**timing, **rounds.stats(), **experts}
    yield text.last(stats)
