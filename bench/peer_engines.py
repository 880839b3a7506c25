"""The engines `bench/peers.py` puts side by side, each behind the same two calls:

- `run(prompt, tokens)`: prefill `prompt` (token ids) from an empty cache, then decode `tokens`
  tokens greedily; returns (prefill tokens/s, decode tokens/s after the first token, the ids);
- `logits(prompt)`: teacher-forced logits (len(prompt), vocab), float64, for the KL columns.

Each times its own work with the same wall clock (`time.perf_counter`), on `threads` CPU threads.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class Lucebox:
    name = "lucebox"

    def __init__(self, path, threads: int):
        import lucebox

        torch.set_num_threads(threads)
        self.llm = lucebox.LLM(path, device="cpu", dtype="float32", draft=None, max_context=4096)

    def run(self, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
        self.llm.drop_cache()  # no prefix reused from the last run
        g = self.llm.generate(prompt, max_tokens=tokens, ignore_eos=True, temperature=0.0)
        return g.stats["prefill_tokens_per_s"], g.stats["decode_tokens_per_s"], list(g.token_ids)

    def logits(self, prompt: list[int]) -> np.ndarray:
        return self.llm.logits(prompt).double().numpy()


class LlamaCpp:
    """llama.cpp through llama-cpp-python: `eval` and the last row's logits, greedy by argmax (its
    sampler chain would add work lucebox and transformers do not do)."""

    name = "llama.cpp"

    def __init__(self, path, threads: int):
        import llama_cpp

        self.path, self.threads = str(path), threads
        self.llm = llama_cpp.Llama(self.path, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def _last(self, llm) -> np.ndarray:
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))

    def run(self, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
        llm = self.llm
        llm.reset()
        llm._ctx.kv_cache_clear()  # (eval also drops the rows past n_tokens)
        start = time.perf_counter()
        llm.eval(prompt)
        out = [int(np.argmax(self._last(llm)))]
        first = time.perf_counter()
        for _ in range(tokens - 1):
            llm.eval(out[-1:])
            out.append(int(np.argmax(self._last(llm))))
        end = time.perf_counter()
        return len(prompt) / (first - start), (tokens - 1) / (end - first), out

    def logits(self, prompt: list[int]) -> np.ndarray:
        import llama_cpp

        llm = llama_cpp.Llama(self.path, n_ctx=4096, n_batch=512, n_threads=self.threads,
                              n_threads_batch=self.threads, logits_all=True, verbose=False)
        llm.eval(prompt)
        return np.array(llm.scores[: len(prompt)], dtype=np.float64)


class Transformers:
    """The transformers model whose weights are what the file decodes to (`tests/gguf_models`), in
    float32: `generate`-free greedy decoding over its own KV cache."""

    name = "transformers"

    def __init__(self, model, threads: int):
        torch.set_num_threads(threads)
        self.model = model.to(torch.float32).eval()

    @torch.inference_mode()
    def run(self, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        out = self.model(torch.tensor([prompt]), use_cache=True)
        ids = [int(out.logits[0, -1].argmax())]
        first = time.perf_counter()
        past = out.past_key_values
        for _ in range(tokens - 1):
            out = self.model(torch.tensor([ids[-1:]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            ids.append(int(out.logits[0, -1].argmax()))
        end = time.perf_counter()
        return len(prompt) / (first - start), (tokens - 1) / (end - first), ids

    @torch.inference_mode()
    def logits(self, prompt: list[int]) -> np.ndarray:
        return self.model(torch.tensor([prompt])).logits[0].double().numpy()


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(p || q) of the softmaxes, in nats (float64)."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())
