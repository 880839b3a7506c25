"""`lucebox.LLM`: load a model once, then generate, stream, or read teacher-forced logits."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from lucebox.arguments import callback, choice, flag, integer, path, stops, token_id_list
from lucebox.caches import KV_POLICIES, CacheSettings, SequenceCache, Step
from lucebox.checkpoints.hf_folder import weight_files
from lucebox.checkpoints.loading import check_load_format, describe_model, load_model, resolve_quantization
from lucebox.device import resolve_device, resolve_dtype
from lucebox.engine.config import DECODE_ROWS, DRAFT_WIDTH
from lucebox.engine.runner import StepRunner
from lucebox.engine.text_stage import TextStage, timing_stats
from lucebox.errors import ContextLengthError, InvalidArgumentError
from lucebox.generation import Chunk, Generation, collect
from lucebox.kernels.backend import kernels_for, resolve_backend
from lucebox.memory.engine import expert_slots_for, plan_vram, stored_weights
from lucebox.memory.expert_cache import ExpertTraffic
from lucebox.memory.plan import check_fits
from lucebox.memory.vram import parse_size
from lucebox.models.hf_config import token_ids
from lucebox.sampling import SamplingParams
from lucebox.speculative import VERIFY_RULES
from lucebox.speculative.drafters import drafter_cost, make_proposer, measure_verify_seconds, resolve_drafter
from lucebox.speculative.proposer import tensor_bytes
from lucebox.speculative.rounds import Speculation
from lucebox.speculative.width import WidthPolicy
from lucebox.text.tokenizer import require_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A loaded model and its engine; without `model`, the built-in code model (`lucebox.builtin`).

    `max_context` bounds prompt + generated tokens of one sequence (default: the model's
    max_position_embeddings). Full-attention layers keep `kv_pool_tokens` tokens of K/V on the
    device and the rest in host memory; `kv_policy` says what a decode step attends to: "exact"
    (everything; the default when the whole context fits the pool) or "select" (sink + recent
    tail + the chunks that score highest; bounded cost at any context, an approximation).
    `prefill_chunk` bounds the rows of one prefill forward, and so the activation memory of long
    prompts (default 2048 on CUDA, 512 on CPU). A prompt that extends the previous request's
    tokens reuses their cache and prefills only the new tokens.

    `draft` picks speculative decoding: None (off, the default), "auto" (the model's paired
    drafter if one ships with it, as the built-in model's does, else none), "ngram" (prompt
    lookup), or a drafter folder (a DFlash drafter or a smaller model sharing the vocabulary). Output is
    the target's own either way. `draft_k` caps drafts per round (the width adapts below it),
    `verify` is "tokenwise" or "block" for sampled decoding, `draft_ctx` is the drafter's context ring in tokens.

    `backend` picks the kernels: "auto" (Triton on CUDA, the torch references on the CPU),
    "triton" (everywhere; on the CPU through Triton's interpreter, TRITON_INTERPRET=1) or "torch".
    `quantization` ("int8" or "int4") quantizes the linear layers' weights as they load
    (round-to-nearest, float16 scales per group: per row for int8, 128 inputs for int4); the
    embeddings, output head and routers stay in `dtype`. A folder written by `lucebox quantize`
    loads as stored, in its own scheme (`quantization` may only repeat it). `cuda_graphs` (default: on with CUDA
    and Triton) runs each decode and verify step as one CUDA graph per width (`lucebox.engine.runner`).
    `load_progress(done, total)` is called with bytes of weights read as they load.

    `vram_budget` ("24GiB", or bytes) plans device memory within that budget from the config
    alone (`lucebox.memory.vram`): it keeps the pool size and prefill chunk you give and chooses
    the others so the plan fits (kept in `vram_plan`), refuses with what does not fit, and on
    CUDA holds the allocator to the budget. When nothing else fits an MoE model, it moves the
    routed experts to host memory (`experts_on_host` None; False forbids it).

    `kv_dtype="int8"` stores the paged pool's K/V rows, and their host copies, as int8 with a
    float32 scale per token and head (`kernels.kv_int8`): about half the bytes of bfloat16, so
    half the host memory and PCIe traffic at long contexts; sliding rings keep `dtype`. Each value
    is off by at most max|row| / 254, plus the model dtype's rounding (the logit error it causes:
    README, "Long contexts").

    `experts_on_host=True` keeps the routed experts in host memory (pinned on CUDA) and
    `expert_slots` of each MoE layer's experts in a device cache (default 8 x top_k); each step
    copies in the chosen experts it lacks (`lucebox.memory.expert_cache`), so steps run eagerly, without
    CUDA graphs. The output is the same as with every expert on the device; `Generation.stats`
    gains `expert_hit_rate`, `expert_hits` and `expert_misses` (per row and choice), `expert_copies`
    and `expert_copied_bytes` (per expert copied in).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        draft: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        max_context: int | None = None,
        kv_policy: str | None = None,
        kv_pool_tokens: int | None = None,
        kv_reselect_every: int = 64,
        prefill_chunk: int | None = None,
        draft_k: int = 15,
        verify: str = "tokenwise",
        draft_ctx: int = 4096,
        adaptive: bool = True,
        backend: str = "auto",
        quantization: str | None = None,
        cuda_graphs: bool | None = None,
        load_progress: Callable[[int, int], None] | None = None,
        vram_budget: str | int | None = None,
        experts_on_host: bool | None = None,
        expert_slots: int | None = None,
        kv_dtype: str | None = None,
    ):
        check_load_format(load_format)
        model, draft = path("model", model, optional=True), path("draft", draft, optional=True)
        verify = choice("verify", verify, VERIFY_RULES)
        self.draft_k = draft_k
        draft_ctx = integer("draft_ctx", draft_ctx, 1)
        adaptive = flag("adaptive", adaptive)
        cuda_graphs = flag("cuda_graphs", cuda_graphs, optional=True)
        experts_on_host = flag("experts_on_host", experts_on_host, optional=True)
        expert_slots = integer("expert_slots", expert_slots, 1, optional=True)
        if expert_slots is not None and experts_on_host is None:
            experts_on_host = True  # asking for a cache size asks for the cache
        self.kv_dtype = choice("kv_dtype", kv_dtype, ("auto", "int8"), optional=True) or "auto"
        callback("load_progress", load_progress)
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            # Triton launches and CUDA graph capture follow the current device, not a tensor's.
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.backend = resolve_backend(backend, self.device, self.dtype)
        if model is None:
            from lucebox.builtin import builtin_model

            model = builtin_model()
        self.description = describe_model(model)
        self.config = self.description.cfg
        prefill_chunk = integer("prefill_chunk", prefill_chunk, 1, optional=True)
        # an unknown scheme, or one a saved quantized checkpoint was not written in, fails here
        self.quantization = quantization = resolve_quantization(quantization, self.description)
        drafter = resolve_drafter(draft, self.description)
        stored = stored_weights(self.description, self.dtype, load_format)  # a GGUF file's own bytes, or None
        self.vram_plan = None
        if vram_budget is not None:
            context = integer("max_context", max_context, 1, optional=True) or self.config.max_position_embeddings
            self.vram_plan = plan_vram(
                self.config, self.device, self.dtype, self.quantization, parse_size(vram_budget), context,
                choice("kv_policy", kv_policy, KV_POLICIES, optional=True),
                integer("kv_pool_tokens", kv_pool_tokens, 1, optional=True), prefill_chunk, drafter, draft_ctx,
                cuda_graphs, experts_on_host, expert_slots, self.kv_dtype == "int8", stored)
            prefill_chunk = self.vram_plan.choices["prefill_chunk"]
            kv_pool_tokens = self.vram_plan.choices["kv_pool_tokens"]
            experts_on_host = self.vram_plan.choices["experts_on_host"]
            expert_slots = self.vram_plan.choices["expert_slots"]
        self.expert_slots = expert_slots_for(self.config, experts_on_host, expert_slots)
        self.expert_traffic = ExpertTraffic()
        self.prefill_chunk = prefill_chunk or (2048 if self.device.type == "cuda" else 512)
        self.cache_settings = self._cache_settings(max_context, kv_policy, kv_pool_tokens, kv_reselect_every)
        self.max_context = self.cache_settings.max_context
        if load_format != "dummy" and self.description.gguf is None:
            weight_files(self.description.folder)  # a folder without weights says so before any memory figure
        cost = drafter_cost(drafter, self.dtype, self.max_context, self.prefill_chunk, draft_ctx, DRAFT_WIDTH)
        self._plan = check_fits(self.config, self.cache_settings, self.dtype, self.device, quantization, cost,
                                self.expert_slots, stored)
        loaded = load_model(self.description, self.dtype, self.device, load_format, kernels_for(self.backend),
                            quantization, load_progress, self.expert_slots, self.expert_traffic)
        self.decoder = loaded.decoder
        self.runner = StepRunner(self.decoder, graphs=self._use_cuda_graphs(cuda_graphs))
        self._tokenizer = loaded.tokenizer
        self.eos_token_ids = self._eos_ids()
        self._session: tuple[SequenceCache, list[int]] | None = None  # cache + the tokens it holds
        self._drafter_follows_session = False
        self._open_streams = 0
        self.verify_rule = verify
        self.adaptive = adaptive
        self.proposer = make_proposer(drafter, self, draft_ctx, DRAFT_WIDTH)
        self._verify_seconds = None
        if self.proposer is not None and adaptive:
            cache = self._new_cache()
            self.runner.bind(cache)
            self._verify_seconds = measure_verify_seconds(self, cache)
            self._session = (cache, [])  # the first request empties it and keeps the graphs captured over it

    def _use_cuda_graphs(self, asked: bool | None) -> bool:
        """Default: on wherever they can run, which is CUDA with the Triton kernels (the torch
        reference MoE syncs with the host, which a graph cannot hold, and so does an expert cache)."""
        possible = self.device.type == "cuda" and self.backend == "triton" and self.expert_slots is None
        if asked and not possible:
            raise InvalidArgumentError("cuda_graphs=True needs device='cuda', the Triton kernels "
                                       "(backend='triton' or 'auto') and the experts on the device; this engine has "
                                       f"{self.device.type}, backend '{self.backend}'"
                                       + (", experts in host memory" if self.expert_slots is not None else ""))
        return possible if asked is None else asked

    def _cache_settings(self, max_context, kv_policy, kv_pool_tokens, reselect_every) -> CacheSettings:
        max_context = integer("max_context", max_context, 1, optional=True) or self.config.max_position_embeddings
        prefill = self.prefill_chunk
        reselect_every = integer("kv_reselect_every", reselect_every, 1)
        kv_pool_tokens = integer("kv_pool_tokens", kv_pool_tokens, 1, optional=True)
        kv_policy = choice("kv_policy", kv_policy, KV_POLICIES, optional=True)
        settings = CacheSettings.for_engine(max_context, prefill, kv_policy, kv_pool_tokens, reselect_every,
                                            kv_int8=self.kv_dtype == "int8")
        settings.kvflash().validate()
        return settings

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
        return require_tokenizer(self._tokenizer, self.description.folder)

    # -- public API -------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, *, max_tokens: int, **options) -> Generation:
        """Generate up to `max_tokens` tokens; options as in `stream`."""
        return collect(self.stream(prompt, max_tokens=max_tokens, **options), self._tokenizer is not None)

    def chat(self, system: str | None = None, **sampling):
        """A multi-turn conversation (`lucebox.chat.session.ChatSession`) in the model's chat template; each
        turn reuses the cache of the ones before, so only the new turn is prefilled. `sampling`: the
        defaults of every turn (`max_tokens`, `temperature`, `top_p`, `stop`, ...)."""
        from lucebox.chat.session import ChatSession

        return ChatSession(self, system, **sampling)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, on_progress: Callable[[int, int], None] | None = None) -> int:
        """Put the prompt's rows in the cache now (reusing a prefix already there), so that the next
        request extending it prefills only its new tokens; `on_progress(done, total)` after each
        chunk. Returns the number of tokens prefilled."""
        ids = self._prompt_ids(prompt)
        callback("on_progress", on_progress)
        self._check_context(len(ids), f"{len(ids)} prompt tokens")
        if self._open_streams:
            raise InvalidArgumentError("prefill() while a stream is open would rewrite the cache that stream "
                                       "reads; finish or close the stream first")
        cache, proposer, _ = self._open_session(ids, private=False)
        reused = cache.length
        for done, _ in enumerate(self._prefill(ids, cache, proposer), 1):
            if on_progress is not None:
                on_progress(min(reused + done * self.prefill_chunk, len(ids)), len(ids))
        return len(ids) - reused

    def drop_cache(self) -> None:
        """Forget the cached conversation (freeing its KV cache and the graphs over it; a drafter
        keeps its own buffers): the next request prefills from scratch."""
        self._session = None
        self.runner.release()

    def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        stop: str | Sequence[str | int] | None = None,
        ignore_eos: bool = False,
        speculate: bool = True,
    ) -> Iterator[Chunk]:
        """Yield chunks of new tokens as they are produced; the last one carries finish_reason and stats.

        `stop` holds stop strings (never emitted) and/or stop token ids (emitted, like EOS).
        `speculate=False` decodes this request without the engine's drafter (to compare the two
        on one set of weights): greedy output is the same token for token, sampled output has the
        same distribution (the draws differ).
        """
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed)
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = integer("max_tokens", max_tokens, 1)
        ignore_eos, speculate = flag("ignore_eos", ignore_eos), flag("speculate", speculate)
        self._check_context(len(prompt_ids) + max_tokens, f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens}")
        stop_strings, stop_ids = self._split_stops(stop)
        stop_ids |= set() if ignore_eos else set(self.eos_token_ids)
        return self._run(prompt_ids, params, max_tokens, stop_strings, stop_ids, speculate)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (len, vocab) through the engine's own chunked prefill path."""
        ids = token_id_list("token_ids", token_ids, self.config.vocab_size)
        if not ids:
            raise InvalidArgumentError("token_ids is empty; give at least one token")
        self._check_context(len(ids), f"{len(ids)} tokens")
        cache = self._new_cache()
        return torch.cat([self.decoder.logits(h) for h in self._prefill(ids, cache)]).to(self._logits_dtype)

    def memory(self) -> dict[str, int]:
        """Bytes: weights, ring caches, device KV pool, KVFlash chunk summaries, host KV now and
        at most, drafter (weights and caches). Before the first request the caches count as planned."""
        weights = tensor_bytes(self.decoder.w.values())
        now = self._session[0].memory() if self._session else {
            "ring_caches": self._plan["ring_caches"], "kv_pool_device": self._plan["kv_pool_device"],
            "kv_chunk_summaries": 0, "kv_host": 0}
        drafter = self._plan["drafter"]
        if self._drafter_follows_session:  # a request has started the drafter (allocating its rings)
            drafter = self.proposer.device_bytes()
        return {"weights": weights, **now, "kv_host_max": self._plan["kv_host_max"], "drafter": drafter}

    # -- the loop ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, prompt_ids, params, max_tokens, stop_strings, stop_ids, speculate) -> Iterator[Chunk]:
        # A second stream opened while one is still running gets a cache of its own.
        private = self._open_streams > 0
        self._open_streams += 1
        try:
            yield from self._decode(prompt_ids, params, max_tokens, stop_strings, stop_ids, private, speculate)
        finally:
            self._open_streams -= 1

    def _decode(self, prompt_ids, params, max_tokens, stop_strings, stop_ids, private, speculate) -> Iterator[Chunk]:
        """One loop for plain and speculative decoding, in three stages: the speculation stage runs
        rounds (draft, one runner step over [last, d1..dk], verify, commit; k = 0 without a
        drafter), the text stage turns committed tokens into chunks and decides when to stop."""
        cache, proposer, tokens = self._open_session(prompt_ids, private, speculate)
        reused = cache.length
        rounds = Speculation(self, params, proposer, prompt_ids)
        text = TextStage(self._tokenizer, prompt_ids, stop_strings, stop_ids, max_tokens)
        traffic = dataclasses.replace(self.expert_traffic)  # this request's expert cache traffic is counted from here
        start = self._clock()
        *_, hidden = self._prefill(prompt_ids, cache, proposer)
        pending = [rounds.first(self.decoder.logits(hidden[-1:]))]
        prefill_done = self._clock()
        while True:
            chunk = text.feed(pending)
            if text.finish is not None:
                break
            yield chunk
            pending = rounds.round(cache, tokens, text.remaining)
        # Tokens after a stop inside a round were committed to the cache: forget them too.
        keep = len(prompt_ids) + len(text.generated) - 1
        if cache.length > keep:
            cache.rollback(keep)
            del tokens[keep:]
        stats = timing_stats(len(prompt_ids), reused, len(text.generated), start, prefill_done, self._clock())
        experts = self.expert_traffic.since(traffic) if self.expert_slots is not None else {}
        yield text.last({**stats, **rounds.stats(), **experts})

    def _width_policy(self, timed: bool) -> WidthPolicy:
        if self._verify_seconds is None:  # fixed width: never judged, never turned off
            return WidthPolicy(DRAFT_WIDTH, {1: 1.0, DECODE_ROWS: 1.0}, min_rounds=2**62,
                               speculating=self.proposer is not None)
        return WidthPolicy(DRAFT_WIDTH, self._verify_seconds, timed=timed)

    def _prefill(self, ids: list[int], cache: SequenceCache, proposer=None) -> Iterator[torch.Tensor]:
        """Forward ids[cache.length:] in chunks of `prefill_chunk` rows; yields each chunk's hidden
        states. A proposer is given every chunk (and its features) as it commits."""
        all_ids = torch.tensor(ids, device=self.device)
        layers = proposer.feature_layers if proposer is not None else ()
        for begin in range(cache.length, len(ids), self.prefill_chunk):
            end = min(begin + self.prefill_chunk, len(ids))
            step = Step.span(begin, end - begin, self.device, prefill=True)
            hidden, features = self.decoder.forward_capturing(all_ids[begin:end], step, cache, layers)
            cache.commit(end)
            if proposer is not None:
                proposer.commit(ids[:end], end - begin, features)
            yield hidden

    def _open_session(self, prompt_ids: list[int], private: bool, speculate: bool = True):
        """The cache for a request (the session's, rolled back to what the prompt shares with it, or a
        private one), the drafter ready for it, and the token list whose rows the cache holds."""
        cache = self._new_cache() if private else self._session_cache(prompt_ids)
        proposer = None if private or not speculate else self.proposer  # a drafter serves one stream at a time
        if proposer is not None and not (self._drafter_follows_session and proposer.resume(cache.length)):
            if proposer.feature_layers:
                cache.rollback(0)  # the drafter needs target features of every row: prefill them again
            proposer.start(prompt_ids, None)
        tokens = list(prompt_ids)  # the cache holds rows of tokens[:cache.length], as commits advance
        if not private:
            self._session = (cache, tokens)
            # whether the drafter has seen every row the session's cache holds (resume can trust it)
            self._drafter_follows_session = proposer is not None
        return cache, proposer, tokens

    def _new_cache(self) -> SequenceCache:
        return SequenceCache(self.config, self.cache_settings, self.dtype, self.device)

    def _session_cache(self, prompt_ids: list[int]) -> SequenceCache:
        """The previous request's cache rolled back to the longest prefix it shares with this prompt
        (at least one prompt token is forwarded again, for its logits), or emptied; a fresh cache
        when it was left dirty."""
        if self._session is not None:
            cache, held = self._session
            held = held[: cache.length]  # a request that failed midway committed only part of its ids
            shared = 0
            for a, b in zip(held, prompt_ids, strict=False):
                if a != b:
                    break
                shared += 1
            keep = min(shared, len(prompt_ids) - 1)
            if keep > 0 and cache.can_rewind_to(keep):
                cache.rollback(keep)
                return cache
            if not cache.dirty:  # nothing shared: its buffers (and the graphs captured over them) serve again
                cache.rollback(0)
                return cache
        self._session = None  # drop the old cache (and the graphs over it) before allocating a new one
        self.runner.release()
        cache = self._new_cache()
        self.runner.bind(cache)
        return cache

    # -- helpers ----------------------------------------------------------------------------------

    def _clock(self, synchronize: bool = True) -> float:
        """Wall time after the device has finished what was queued, so timings are honest on CUDA
        (unsynchronized: only the host's time, for figures nothing decides on)."""
        if synchronize and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def _logits_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype

    def _eos_ids(self) -> tuple[int, ...]:
        ids = list(self.config.eos_token_ids) + list(token_ids(self.description.generation_config.get("eos_token_id")))
        if self._tokenizer is not None:
            ids += self._tokenizer.eos_token_ids
        return tuple(dict.fromkeys(ids))

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

    def _split_stops(self, stop) -> tuple[list[str], set[int]]:
        strings, ids = stops(stop, self.config.vocab_size)
        if strings and self._tokenizer is None:
            require_tokenizer(None, self.description.folder)
        return strings, ids
