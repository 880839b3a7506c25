"""`lucebox.LLM`: load a model once, then generate, stream, or read teacher-forced logits.

Opening one is three steps, each a function with one job: the configuration (`EngineConfig`, every
argument checked and every default defined there), the setup (`engine.setup.plan_engine`: device,
model, drafter, memory plan) and the build (`engine.build.build_engine`: weights, runner,
drafter). A request's options are one checked `RequestOptions` (`lucebox.request_options`), whether
given whole or as keywords; the request runs in `engine.request`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import torch

from lucebox.arguments import callback, integer, token_id_list
from lucebox.constrained import GrammarState, constraint_from
from lucebox.constrained.spec import Constraint, refuse_stops
from lucebox.constrained.thought_first import thought_close_grammar
from lucebox.engine.build import Engine, build_engine
from lucebox.engine.config import EngineConfig
from lucebox.engine.request import Request, run_request
from lucebox.engine.session import Session
from lucebox.engine.setup import EngineSetup, plan_engine
from lucebox.errors import ContextLengthError, InvalidArgumentError
from lucebox.generation import Chunk, Generation, collect
from lucebox.kernels.quant import kept_dense_bytes
from lucebox.limits import DRAFT_WIDTH
from lucebox.request_options import RequestOptions
from lucebox.speculative.proposer import tensor_bytes
from lucebox.text.tokenizer import require_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A loaded model and its engine; without `model`, the built-in code model (`lucebox.builtin`).

    Keyword arguments are the fields of `lucebox.engine.config.EngineConfig`, which documents each
    one and its default: `draft`, `device`, `dtype`, `load_format`, `max_context`, `kv_policy`,
    `kv_pool_tokens`, `kv_reselect_every`, `prefill_chunk`, `draft_k`, `verify`, `draft_ctx`,
    `adaptive`, `tree_budget`, `backend`, `quantization`, `cuda_graphs`, `vram_budget`, `experts_on_host`,
    `expert_slots`, `kv_dtype`, `lm_head`. A whole configuration can be given instead (`config=`, `LLM.from_config`).
    `load_progress(done, total)` is called with bytes of weights read as they load; on a GPU every
    decode/verify step graph is then captured before the first request, `capture_progress(done,
    total)` called after each.

    A prompt that extends the previous request's tokens reuses their cache and prefills only the
    new tokens. `kv_policy="exact"` attends to every cached token (the full model, within
    floating point); `"select"` to sink + recent tail + the chunks that score highest (bounded cost
    at any context, an approximation). With `experts_on_host`, `Generation.stats` gains
    `expert_hit_rate`, `expert_hits`, `expert_misses`, `expert_copies` and `expert_copied_bytes`.
    """

    def __init__(self, model=None, *, load_progress: Callable[[int, int], None] | None = None,
                 config: EngineConfig | None = None, capture_progress: Callable[[int, int], None] | None = None,
                 **options):
        if config is not None and (model is not None or options):
            raise InvalidArgumentError("give LLM either a config or the model and its options, not both; "
                                       "config.replace(...) changes a config")
        self._open(config or EngineConfig(model, **options), load_progress, capture_progress)

    @classmethod
    def from_config(cls, config: EngineConfig, load_progress: Callable[[int, int], None] | None = None,
                    capture_progress: Callable[[int, int], None] | None = None) -> LLM:
        """The engine `config` describes (the CLI, the server and `bench` open theirs this way)."""
        return cls(config=config, load_progress=load_progress, capture_progress=capture_progress)

    def _open(self, config: EngineConfig, load_progress, capture_progress) -> None:
        callback("load_progress", load_progress)
        callback("capture_progress", capture_progress)
        self.setup: EngineSetup = plan_engine(config)
        self.engine: Engine = build_engine(self.setup, load_progress)
        self.session = Session(self.engine, config.parallel)
        self.draft_k = config.draft_k
        if self.engine.runner.graphs and self.engine.runner.capture:  # a GPU: no request waits for a capture
            self.session.capture_graphs(capture_progress)
        if self.engine.proposer is not None and config.adaptive:
            self.session.warm()  # the adaptive width's start-up cost table, on the cache the first request reuses

    # What users of a model read; the rest through `setup` (what was settled: backend, quantization,
    # cache settings, prefill chunk...) and `engine` (the built parts: decoder, runner...).
    engine_config = property(lambda self: self.setup.config, doc="The `EngineConfig` this engine was opened with.")
    config = property(lambda self: self.setup.model, doc="The model's normalized `ModelConfig`.")
    description = property(lambda self: self.setup.description)
    device = property(lambda self: self.setup.device)
    dtype = property(lambda self: self.setup.dtype)
    vram_plan = property(lambda self: self.setup.vram_plan)
    max_context = property(lambda self: self.setup.cache.max_context)
    proposer = property(lambda self: self.engine.proposer)
    eos_token_ids = property(lambda self: self.engine.eos_token_ids)

    @property
    def draft_k(self) -> int:
        """The most drafts a round verifies (the width adapts below it); settable between requests."""
        return self._draft_k

    @draft_k.setter
    def draft_k(self, k: int) -> None:
        self._draft_k = integer("draft_k", k, 1, DRAFT_WIDTH)

    @property
    def tokenizer(self):
        """The model's tokenizer; raises TokenizerError when the folder has no tokenizer files."""
        return require_tokenizer(self.engine.tokenizer, self.description.folder)

    # -- public API -------------------------------------------------------------------------------

    def generate(self, prompt: Prompt | list[Prompt], options: RequestOptions | None = None,
                 **keywords) -> Generation | list[Generation]:
        """The whole output of `stream(prompt, options, **keywords)`; for a list of prompts (texts or
        lists of token ids), each one's, in order, run `parallel` at a time (`EngineConfig.parallel`),
        their steps sharing each forward. Every output is what its prompt alone gives."""
        if not _is_batch(prompt):
            return collect(self.stream(prompt, options, **keywords), self.engine.tokenizer is not None)
        streams = [self.stream(one, options, **keywords) for one in prompt]  # every request checked first
        texts, stop = self.engine.tokenizer is not None, threading.Event()

        def run(chunks: Iterator[Chunk]) -> Generation:
            with closing(chunks):  # its slot is free when it ends, however it ends
                return collect(_until(stop, chunks), texts)

        pool = ThreadPoolExecutor(self.setup.config.parallel, thread_name_prefix="lucebox-generate")
        try:
            return list(pool.map(run, streams))
        except BaseException:  # Ctrl-C: the others stop at their next chunk, the waiting ones never start
            stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            for chunks in streams:
                chunks.close()  # those that never started

    def chat(self, system: str | None = None, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool | None = None, tool_parser: str | None = None, **sampling):
        """A multi-turn conversation (`lucebox.chat.ChatSession`) in the model's chat template; each
        turn reuses the cache of the ones before, so only the new turn is prefilled. `sampling`: the
        defaults of every turn (`max_tokens`, `temperature`, `top_p`, `stop`, `json_schema`, ...).
        `tools`, `tool_choice`, `parallel_tool_calls`: as OpenAI's API takes them (function schemas;
        "auto", "none", "required" or {"type": "function", "function": {"name": ...}}); `tool_parser`: the
        call syntax ("hermes", "llama3", "mistral", "qwen3_coder") when the chat template's is not the one to parse
        (None: the template's own, as `lucebox serve --tool-parser`)."""
        from lucebox.chat import ChatSession

        return ChatSession(self, system, tools, tool_choice, parallel_tool_calls, tool_parser, **sampling)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, on_progress: Callable[[int, int], None] | None = None) -> int:
        """Put the prompt's rows in the cache now (reusing a prefix already there), so that the next
        request extending it prefills only its new tokens; `on_progress(done, total)` after each
        chunk. Returns the number of tokens prefilled."""
        ids = self._prompt_ids(prompt)
        callback("on_progress", on_progress)
        self._check_context(len(ids), f"{len(ids)} prompt tokens")
        if self.session.open_streams:
            raise InvalidArgumentError("prefill() while a stream is open would rewrite the cache that stream "
                                       "reads; finish or close the stream first")
        cache, proposer = self.session.open(ids)
        reused = cache.length
        try:
            for done, _ in enumerate(self.engine.prefill(ids, cache, proposer, (len(ids) - 1, len(ids))), 1):
                if on_progress is not None:
                    on_progress(min(reused + done * self.setup.prefill_chunk, len(ids)), len(ids))
        finally:
            self.session.keep(cache, ids)
        return len(ids) - reused

    def drop_cache(self) -> None:
        """Forget the cached conversations of the slots no request runs in (freeing their KV caches
        and the graphs over the first one's; drafters keep their own buffers): a later request
        prefills from scratch."""
        self.session.drop()

    def stream(self, prompt: Prompt, options: RequestOptions | None = None, **keywords) -> Iterator[Chunk]:
        """Yield chunks of new tokens as they are produced; the last one carries finish_reason and stats.

        `options`: a `lucebox.request_options.RequestOptions` (what each option does), or its fields as
        keywords, SamplingParams' among them: `stream(prompt, max_tokens=64, temperature=0.8)` is
        `stream(prompt, RequestOptions(max_tokens=64, sampling=SamplingParams(temperature=0.8)))`.
        What the engine cannot compile of a constraint: GrammarError naming its field.
        """
        if options is None:
            options = RequestOptions.from_keywords(self.config.vocab_size, **keywords)
        elif keywords or not isinstance(options, RequestOptions):
            raise InvalidArgumentError("stream and generate take a RequestOptions or its fields as keywords, got "
                                       f"{type(options).__name__}{' and keywords' if keywords else ''}")
        else:
            options.check_token_ids(self.config.vocab_size)
        return run_request(self.engine, self.session, self._request(prompt, options))

    def _request(self, prompt: Prompt, options: RequestOptions) -> Request:
        """`options` on `prompt`, checked against this model: the constraint compiled, the context the
        prompt leaves, stop strings (which need a tokenizer), the snapshot positions."""
        constraint = constraint_from(options.json_schema, options.grammar, options.json_object)
        prompt_ids = self._prompt_ids(prompt)
        self._check_context(len(prompt_ids) + options.max_tokens,
                            f"{len(prompt_ids)} prompt tokens + max_tokens {options.max_tokens}")
        if options.stop_strings and self.engine.tokenizer is None:
            require_tokenizer(None, self.description.folder)
        if options.makes_json:  # a stop string could end the output inside its JSON
            refuse_stops(options.stop_strings, "json_schema" if options.json_schema is not None else "json_object",
                         options.json_schema if options.json_schema is not None else {"type": "object"})
        for position in options.snapshot_at:
            integer("snapshot_at", position, 1, len(prompt_ids))
        stop_ids = set(options.stop_ids) | (set() if options.ignore_eos else set(self.eos_token_ids))
        state = None if constraint is None else GrammarState(constraint, self.engine.tokenizer, self.config.vocab_size,
                                                               tuple(self.eos_token_ids), self.device)
        close = None if options.thought_budget is None else GrammarState(
            Constraint.lark(options.after_thought or thought_close_grammar(), "thought_budget"), self.engine.tokenizer,
            self.config.vocab_size, tuple(self.eos_token_ids), self.device)
        return Request(prompt_ids, options, stop_ids, self.draft_k, state, close)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (len, vocab) through the engine's own chunked prefill path."""
        ids = token_id_list("token_ids", token_ids, self.config.vocab_size)
        if not ids:
            raise InvalidArgumentError("token_ids is empty; give at least one token")
        self._check_context(len(ids), f"{len(ids)} tokens")
        hidden = self.engine.prefill(ids, self.engine.new_cache())
        return torch.cat([self.engine.decoder.logits(h) for h in hidden]).to(self.engine.logits_dtype)

    def memory(self) -> dict[str, int]:
        """Bytes: weights, ring caches, device KV pool, KVFlash chunk summaries, host KV now and
        at most, drafter (weights and caches), the dense copies of quantized weights the CPU keeps now
        and at most. Before the first request the caches count as planned."""
        planned = self.setup.memory
        caches = [slot.cache.memory() for slot in self.session.slots if slot.cache is not None]
        now = {kind: sum(c[kind] for c in caches) for kind in caches[0]} if caches else {
            "ring_caches": planned["ring_caches"], "kv_pool_device": planned["kv_pool_device"],
            "kv_chunk_summaries": 0, "kv_host": 0}
        drafter = planned["drafter"]
        started = [slot.proposer for slot in self.session.slots if slot.drafter_follows]
        if started:  # requests have started drafters (allocating their rings); the weights are shared
            drafter = started[0].device_bytes() + sum(p.device_bytes() - p.weight_bytes() for p in started[1:])
        weights = tensor_bytes(self.engine.decoder.w.values())
        return {"weights": weights, **now, "kv_host_max": planned["kv_host_max"], "drafter": drafter,
                "dense_copies_cpu": kept_dense_bytes(self.engine.decoder.w.values()),
                "dense_copies_cpu_max": planned["dense_copies_cpu_max"]}

    # -- checks -----------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = token_id_list("the prompt (text or token ids)", prompt, self.config.vocab_size)
        if not ids:
            raise InvalidArgumentError("the prompt is empty; give at least one token")
        return ids

    def _check_context(self, needed: int, what: str) -> None:
        if needed > self.max_context:
            raise ContextLengthError(
                f"{what} need {needed} tokens of context but max_context is {self.max_context}; "
                "shorten the prompt, lower max_tokens, or open the model with a larger max_context"
            )


def _is_batch(prompt) -> bool:
    """Whether `prompt` is a list of prompts (texts or token id lists), not one prompt."""
    return isinstance(prompt, list | tuple) and bool(prompt) and all(
        isinstance(one, str) or (isinstance(one, list | tuple) and not isinstance(one, str)) for one in prompt)


def _until(stop: threading.Event, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """`chunks` until `stop` is set (checked between chunks): then KeyboardInterrupt, as the caller's."""
    for chunk in chunks:
        if stop.is_set():
            raise KeyboardInterrupt
        yield chunk
