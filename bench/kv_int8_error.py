"""The logit error int8 K/V causes (`kv_dtype="int8"`), on the built-in code model and held-out text.

The same held-out standard-library text (not trained on) goes through the model with the KV pool in
float32 and in int8, both with a pool smaller than the context (chunks leave for the host and come
back): a chunked prefill of `--context` tokens, then `--decode` teacher-forced decode steps, one
token each (where `select` attends to sink, tail and chosen chunks), under `exact` and `select`.
Per position it records the largest logit
difference, relative to that position's largest logit; the KL divergence from the float32
distribution; whether the greedy token agrees; and the mean log-likelihood of the text (whose
change is what a user would notice).

    python bench/kv_int8_error.py                         # bench/results/local/
    python bench/kv_int8_error.py --out bench/results     # replaces the committed result
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402


def compare(want: torch.Tensor, got: torch.Tensor, tokens: list[int]) -> dict:
    """Figures over positions: logits (T, V) of the float32 pool and of the int8 one."""
    rel = (got - want).abs().amax(-1) / want.abs().amax(-1)
    log_p, log_q = torch.log_softmax(want.double(), -1), torch.log_softmax(got.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    nxt = torch.tensor(tokens[1:])
    nll_p = -log_p[:-1].gather(-1, nxt[:, None]).mean().item()
    nll_q = -log_q[:-1].gather(-1, nxt[:, None]).mean().item()
    return {"max_relative_logit_error": rel.max().item(), "mean_relative_logit_error": rel.mean().item(),
            "max_kl": kl.max().item(), "mean_kl": kl.mean().item(),
            "greedy_agreement": (want.argmax(-1) == got.argmax(-1)).double().mean().item(),
            "nll_per_token_float32_pool": nll_p, "nll_per_token_int8_pool": nll_q}


@torch.inference_mode()
def teacher_forced(llm, tokens: list[int], prefill: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(prefill logits, decode logits, the cache's memory at the end): tokens[:prefill] prefilled
    in chunks, then each later token fed as a one-token decode step."""
    from lucebox.caches import Step

    cache = llm.engine.new_cache()
    first = torch.cat([llm.engine.decoder.logits(h) for h in llm.engine.prefill(tokens[:prefill], cache)])
    ids = torch.tensor(tokens)
    steps = []
    for position in range(prefill, len(tokens)):
        step = Step.span(position, 1, llm.device)
        hidden, _ = llm.engine.decoder.forward_capturing(ids[position : position + 1], step, cache, ())
        steps.append(llm.engine.decoder.logits(hidden))
        cache.commit(position + 1)
    return first.float(), torch.cat(steps).float(), cache.memory()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=3072, help="prompt tokens (prefilled)")
    p.add_argument("--decode", type=int, default=256, help="tokens fed one by one as decode steps after it")
    p.add_argument("--pool", type=int, default=1024, help="kv_pool_tokens (smaller than --context: offload)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()

    import lucebox
    from lucebox.training.corpus import read_texts, stdlib_files

    text = "\n".join(read_texts(stdlib_files("held_out")[:20]))
    total = args.context + args.decode
    results = {}
    for policy in ("exact", "select"):
        options = dict(device="cpu", dtype="float32", max_context=total, kv_pool_tokens=args.pool,
                       kv_policy=policy, prefill_chunk=256)
        plain, int8 = lucebox.LLM(**options), lucebox.LLM(kv_dtype="int8", **options)
        tokens = plain.tokenizer.encode(text)[:total]
        (want_prefill, want_decode, want_memory), (got_prefill, got_decode, got_memory) = (
            teacher_forced(llm, tokens, args.context) for llm in (plain, int8))
        results[policy] = {"prefill": compare(want_prefill, got_prefill, tokens[: args.context]),
                           "decode": compare(want_decode, got_decode, tokens[args.context :]),
                           "kv_host_bytes": {"float32": want_memory["kv_host"], "int8": got_memory["kv_host"]}}
        for part in ("prefill", "decode"):
            print(policy, part, {k: round(v, 6) for k, v in results[policy][part].items()})
        print(policy, "host KV bytes", results[policy]["kv_host_bytes"])
    payload = {"model": "built-in laguna-code-6m (float32)", "text": "held-out standard-library files",
               "setup": {"context": args.context, "decode_steps": args.decode, "kv_pool_tokens": args.pool,
                         "prefill_chunk": 256},
               "results": results}
    print(write_result("kv_int8_error", payload, args.out))


if __name__ == "__main__":
    main()
