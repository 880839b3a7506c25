"""Default speculation against plain decoding at each temperature: whether speculation ever loses.

    python bench/speculative_temperatures.py                                  # 0, 0.4, 0.8, 1.0, 1.2
    python bench/speculative_temperatures.py --out bench/results              # replace the committed result
    python bench/speculative_temperatures.py --cpu-time                       # on a host other processes load

The built-in model and its drafter with the engine's defaults (the width policy chooses how many
drafts a round verifies, or none), against `draft=None`, on the first `--prompt-tokens` tokens of
held-out standard-library files (`bench/speculative.py`'s prompts). Sampled requests are unseeded,
as a user's are: a seeded one cannot let the clock choose its widths. Each prompt is decoded by both
engines in turn at every temperature, `--repeats` times; a prompt's figure is its median run; the
speed-up is decode tokens/s summed over the prompts, speculation over plain.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402
from bench.speculative import _median_times, prompts_from_held_out  # noqa: E402


def main() -> None:
    import torch

    import lucebox

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperatures", default="0,0.4,0.8,1.0,1.2", help="comma-separated (default 0,0.4,0.8,1.0,1.2)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-time", action="store_true",
                   help="rate by this thread's CPU time over each whole request (its prefill too, the same for both), "
                        "not the decode's wall clock: on a shared host that also counts other processes' turns")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as bench/verify_rows.py)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                               "bench/results replaces the committed result)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    engines = {"plain": lucebox.LLM(device="cpu", dtype="float32", draft=None),
               "speculative": lucebox.LLM(device="cpu", dtype="float32")}
    prompts = prompts_from_held_out(engines["plain"].tokenizer, args.prompts, args.prompt_tokens)
    for engine in engines.values():  # warm-up: first-call costs stay out of the figures
        engine.generate(prompts[0][1][:16], max_tokens=8, ignore_eos=True)
    runs = {(name, t): [] for name in engines for t in temperatures}
    for _, prompt in prompts:
        for _ in range(args.repeats):
            for t in temperatures:
                for name, engine in engines.items():  # in turn: a slow stretch of the host touches both
                    start = time.thread_time()
                    g = engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True, temperature=t)
                    if args.cpu_time:
                        g.stats["decode_time_s"] = time.thread_time() - start
                    runs[name, t].append(g)
    rows = []
    for t in temperatures:
        rate = {}
        for name in engines:
            seconds, tokens = _median_times(runs[name, t], len(prompts), args.repeats)
            rate[name] = tokens / seconds
        gens = runs["speculative", t]
        rounds = sum(g.stats["rounds"] for g in gens)
        kept = sum(g.stats["acceptance_length"] * g.stats["rounds"] for g in gens)
        rows.append({"temperature": t, "plain_tokens_per_s": round(rate["plain"], 2),
                     "speculative_tokens_per_s": round(rate["speculative"], 2),
                     "speedup_vs_plain": round(rate["speculative"] / rate["plain"], 3),
                     "acceptance_length": round(kept / rounds, 3) if rounds else 0.0})
        print(f"T={t:<4} plain {rate['plain']:7.1f} tok/s  speculative {rate['speculative']:7.1f} tok/s  "
              f"x{rows[-1]['speedup_vs_plain']:.2f}  acceptance length {rows[-1]['acceptance_length']:.2f}", flush=True)
    path = write_result("speculative-temperatures", {
        "model": "built-in", "prompts": [name for name, _ in prompts], "prompt_tokens": args.prompt_tokens,
        "generated_tokens": args.tokens, "repeats": args.repeats, "threads": args.threads,
        "clock": "thread CPU time of each request" if args.cpu_time else "decode wall time", "results": rows,
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
