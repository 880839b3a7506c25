"""`lucebox.LLM`: load a model once, then generate, stream, or read teacher-forced logits."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from lucebox.cache import SequenceCache
from lucebox.device import resolve_device, resolve_dtype
from lucebox.errors import ContextLengthError, InvalidArgumentError
from lucebox.generation import Chunk, Generation
from lucebox.loading import load_model
from lucebox.models.hf_config import token_ids
from lucebox.sampling import SamplingParams, next_token
from lucebox.stopping import StopStrings
from lucebox.tokenizer import IncrementalDecoder, require_tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A loaded model and its engine.

    `max_context` bounds prompt + generated tokens of one sequence (default: the model's
    max_position_embeddings). `prefill_chunk` bounds the rows of one prefill forward, and so the
    activation memory of long prompts (default 2048 on CUDA, 512 on CPU).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        draft: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        load_format: str = "auto",
        max_context: int | None = None,
        prefill_chunk: int | None = None,
    ):
        if draft is not None:
            raise InvalidArgumentError("draft=: speculative decoding is not available in this version; use draft=None")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        loaded = load_model(model, self.dtype, self.device, load_format)
        self.description = loaded.description
        self.config = loaded.description.cfg
        self.decoder = loaded.decoder
        self._tokenizer = loaded.tokenizer
        self.max_context = int(max_context or self.config.max_position_embeddings)
        if self.max_context <= 0:
            raise InvalidArgumentError(f"max_context must be a positive number of tokens, got {max_context}")
        self.prefill_chunk = int(prefill_chunk or (2048 if self.device.type == "cuda" else 512))
        if self.prefill_chunk <= 0:
            raise InvalidArgumentError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.eos_token_ids = self._eos_ids()

    @property
    def tokenizer(self):
        """The model's tokenizer; raises TokenizerError when the folder has no tokenizer files."""
        return require_tokenizer(self._tokenizer, self.description.folder)

    # -- public API -------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, *, max_tokens: int, **options) -> Generation:
        """Generate up to `max_tokens` tokens; options as in `stream`."""
        token_ids: list[int] = []
        texts: list[str] = []
        last = None
        for chunk in self.stream(prompt, max_tokens=max_tokens, **options):
            token_ids.extend(chunk.token_ids)
            if chunk.text is not None:
                texts.append(chunk.text)
            last = chunk
        text = "".join(texts) if self._tokenizer is not None else None
        return Generation(token_ids, last.finish_reason, last.stats, text)

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
    ) -> Iterator[Chunk]:
        """Yield chunks of new tokens as they are produced; the last one carries finish_reason and stats.

        `stop` holds stop strings (never emitted) and/or stop token ids (emitted, like EOS).
        """
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty, seed)
        prompt_ids = self._prompt_ids(prompt)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        self._check_context(len(prompt_ids) + max_tokens, f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens}")
        stop_strings, stop_ids = self._split_stops(stop)
        stop_ids |= set() if ignore_eos else set(self.eos_token_ids)
        return self._run(prompt_ids, params, max_tokens, stop_strings, stop_ids)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (len, vocab) through the engine's own chunked prefill path."""
        ids = self._prompt_ids(list(token_ids))
        self._check_context(len(ids), f"{len(ids)} tokens")
        cache = SequenceCache(self.config, len(ids), self.dtype, self.device)
        return torch.cat([self.decoder.logits(h) for h in self._prefill(ids, cache)]).to(self._logits_dtype)

    # -- the loop ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _run(self, prompt_ids, params, max_tokens, stop_strings, stop_ids) -> Iterator[Chunk]:
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else int(torch.seed() % 2**63))
        seen = torch.zeros(self.config.vocab_size, dtype=torch.bool, device=self.device)
        seen[torch.tensor(prompt_ids, device=self.device)] = True
        cache = SequenceCache(self.config, len(prompt_ids) + max_tokens, self.dtype, self.device)
        text = IncrementalDecoder(self._tokenizer, prompt_ids) if self._tokenizer is not None else None
        stops = StopStrings(stop_strings)

        start = time.perf_counter()
        *_, hidden = self._prefill(prompt_ids, cache)
        logits = self.decoder.logits(hidden[-1:])[0]
        generated: list[int] = []
        prefill_done = decode_start = time.perf_counter()
        finish = None
        while True:
            token = next_token(logits, params, seen, generator)
            if not generated:
                decode_start = time.perf_counter()
            generated.append(token)
            seen[token] = True
            new_text, stopped = None, False
            if text is not None:
                new_text, stopped = stops.feed(text.push([token]))
            if stopped or token in stop_ids:
                finish = "stop"
            elif len(generated) >= max_tokens:
                finish = "length"
            if finish is not None:
                break
            yield Chunk([token], new_text)
            position = torch.tensor([cache.length], device=self.device)
            hidden = self.decoder.forward(torch.tensor([token], device=self.device), position, cache)
            cache.length += 1
            logits = self.decoder.logits(hidden)[0]
        if text is not None and not stopped:
            new_text += stops.feed(text.flush())[0] + stops.flush()
        stats = self._stats(len(prompt_ids), len(generated), start, prefill_done, decode_start, time.perf_counter())
        yield Chunk([token], new_text, finish, stats)

    def _prefill(self, ids: list[int], cache: SequenceCache) -> Iterator[torch.Tensor]:
        """Forward the prompt in chunks of `prefill_chunk` rows; yields each chunk's hidden states."""
        all_ids = torch.tensor(ids, device=self.device)
        for begin in range(cache.length, len(ids), self.prefill_chunk):
            end = min(begin + self.prefill_chunk, len(ids))
            positions = torch.arange(begin, end, device=self.device)
            yield self.decoder.forward(all_ids[begin:end], positions, cache)
            cache.length = end

    # -- helpers ----------------------------------------------------------------------------------

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
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidArgumentError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})"
                )
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
        if stop is None:
            return [], set()
        items = [stop] if isinstance(stop, (str, int)) else list(stop)
        strings = [s for s in items if isinstance(s, str)]
        ids = {int(s) for s in items if not isinstance(s, str)}
        if strings and self._tokenizer is None:
            require_tokenizer(None, self.description.folder)
        return strings, ids

    @staticmethod
    def _stats(prompt_len: int, n: int, start: float, prefill_done: float, decode_start: float, end: float) -> dict:
        prefill_s = max(prefill_done - start, 1e-9)
        decode_s = max(end - decode_start, 1e-9)
        return {
            "prompt_tokens": prompt_len,
            "generated_tokens": n,
            "prefill_time_s": prefill_s,
            "decode_time_s": decode_s,
            "prefill_tokens_per_s": prompt_len / prefill_s,
            # The first token comes from the prefill's logits; decode speed counts the rest.
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 else 0.0,
            "tokens_per_s": n / max(end - start, 1e-9),
        }
