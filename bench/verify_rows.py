"""What one target step costs by its rows on this machine: the price a speculative round pays to
verify each draft row beside the one a plain step decodes (what the width policy's cost line learns).

    python bench/verify_rows.py                       # the built-in model, 1 thread, 1-16 rows
    python bench/verify_rows.py --sampled 0.8         # + what sampled speculation could reach at best
    python bench/verify_rows.py --cpu-time            # CPU time, for a host other processes load
    python bench/verify_rows.py --sampled 0.8 --out bench/results   # replace the committed result

The prompt is the start of a held-out standard-library file (`bench/speculative.py`); each width is
the median of `--reps` steps at the prompt's end through the engine's own runner, each rolled back,
the widths taking turns.

`--sampled T` also decodes `--prompts` held-out prompts at temperature T (seeded, the default coupled
rule), plainly and with a fixed chain of `--width` drafts every round, and prices an oracle from
them: a policy that knew before each round how many of its drafts would be kept, verified exactly
those (n kept drafts: a step of n + 1 rows, from the table above) and drafted only when one would be
kept. No real policy beats it with this drafter. A round keeping n drafts costs the plain run's
mean round plus the step table's price of n + 1 rows over one; drafting, the fixed run's mean per
round. Each of these leans toward speculation, so the oracle is if anything optimistic: that mean
counts prompt-lookup rounds, whose copies cost next to nothing; the table's steps capture no
features for the drafter; a round's commit into the drafter is left out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402
from bench.gpu_step_profile import step_seconds  # noqa: E402
from bench.speculative import prompts_from_held_out  # noqa: E402


def main() -> None:
    import torch

    import lucebox

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="1,2,3,4,8,16", help="rows per step, comma-separated (default 1,2,3,4,8,16)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="context before the steps (default 1024)")
    p.add_argument("--reps", type=int, default=30, help="steps timed per width; the median is kept (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as bench/peers.py)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time each step by this thread's CPU time, not the wall clock, and keep the least of the reps: "
                        "on a shared host the wall clock also counts other processes' turns")
    p.add_argument("--sampled", type=float, default=None, metavar="T",
                   help="also price the best sampled speculation at temperature T (default: off)")
    p.add_argument("--width", type=int, default=7, help="drafts per round of the fixed chain (default 7)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts decoded by --sampled (default 4)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each prompt decodes (default 128)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                               "bench/results replaces the committed result)")
    args = p.parse_args()
    if args.cpu_time and args.sampled is not None:  # its rounds are timed by the wall clock: one unit per figure
        p.error("--sampled prices rounds timed by the wall clock: run it without --cpu-time")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    llm = lucebox.LLM(device="cpu", dtype="float32")
    name, prompt = prompts_from_held_out(llm.tokenizer, 1, args.prompt_tokens)[0]
    cache = llm.engine.new_cache()
    llm.engine.runner.bind(cache)
    for _ in llm.engine.prefill(prompt, cache):
        pass
    cache.commit(len(prompt))
    oracle_rows = set(range(1, args.width + 2)) if args.sampled is not None else set()  # n kept drafts: n + 1 rows
    widths = sorted({int(w) for w in args.widths.split(",")} | oracle_rows)
    samples: dict[int, list[float]] = {w: [] for w in widths}
    for _ in range(args.reps):  # widths in turn, so that a slow stretch of the machine touches all of them
        for w in widths:
            samples[w].append(step_seconds(llm, cache, w, len(prompt), 1, clock))
    keep = min if args.cpu_time else (lambda times: sorted(times)[len(times) // 2])
    seconds = {w: keep(times) for w, times in samples.items()}
    rows = [{"rows": w, "ms": round(s * 1e3, 3), "over_one_row": round(s / seconds[widths[0]], 3)}
            for w, s in seconds.items()]
    for row in rows:
        print(f"{row['rows']:3d} rows {row['ms']:7.2f} ms  x{row['over_one_row']:.2f}", flush=True)
    result = {"model": "built-in", "prompt": name, "context": len(prompt), "threads": args.threads,
              "reps": args.reps, "clock": "thread CPU time, least" if args.cpu_time else "wall, median", "steps": rows}
    if args.sampled is not None:
        result["sampled"] = sampled_ceiling(args, seconds)
    path = write_result("verify_rows", result, args.out)
    print(f"wrote {path}")


def sampled_ceiling(args, step_s: dict[int, float]) -> dict:
    """Plain and fixed-width decoding at `args.sampled`, and the oracle priced from them (module docstring)."""
    import lucebox

    runs = {}
    for label, options in (("plain", {"draft": None}),
                           ("fixed", {"adaptive": False, "draft_k": args.width, "tree_budget": 0})):
        llm = lucebox.LLM(device="cpu", dtype="float32", **options)
        totals = {"tokens": 0, "rounds": 0, "decode_s": 0.0, "draft_s": 0.0, "kept": {}}
        for seed, (_, ids) in enumerate(prompts_from_held_out(llm.tokenizer, args.prompts, args.prompt_tokens)):
            stats = llm.generate(ids, max_tokens=args.tokens, temperature=args.sampled, seed=seed).stats
            totals["tokens"] += stats["generated_tokens"] - 1  # the first token comes from the prefill
            totals["rounds"] += stats["rounds"]
            totals["decode_s"] += stats["decode_time_s"]
            totals["draft_s"] += stats["draft_time_s"]
            for n, count in stats["accepted_histogram"].items():
                totals["kept"][n] = totals["kept"].get(n, 0) + count
        runs[label] = totals
    plain, fixed = runs["plain"], runs["fixed"]
    round_s = plain["decode_s"] / plain["rounds"]  # a plain round: its step and everything around it
    drafting_s = fixed["draft_s"] / fixed["rounds"]
    kept = fixed["kept"]
    tokens = sum((n + 1) * c for n, c in kept.items())
    # A round keeping n drafts: a plain round plus what its n + 1 rows cost over one, from the table.
    verify_s = sum((round_s + step_s[n + 1] - step_s[1]) * c for n, c in kept.items())
    drafted = sum(c for n, c in kept.items() if n > 0)
    plain_rate = 1 / round_s
    figures = {
        "temperature": args.sampled, "prompts": args.prompts, "tokens_per_prompt": args.tokens,
        "fixed_width": args.width,
        "plain_round_ms": round(round_s * 1e3, 3),
        "drafting_ms_per_round": round(drafting_s * 1e3, 3),
        "kept_histogram": {str(n): kept[n] for n in sorted(kept)},
        "acceptance_length": round(tokens / fixed["rounds"], 3),
        "fixed_over_plain": round((fixed["tokens"] / fixed["decode_s"]) / (plain["tokens"] / plain["decode_s"]), 3),
        "oracle_free_drafting_over_plain": round(tokens / verify_s / plain_rate, 3),
        "oracle_over_plain": round(tokens / (verify_s + drafted * drafting_s) / plain_rate, 3),
    }
    print(f"T={args.sampled}: plain round {figures['plain_round_ms']} ms, "
          f"drafting {figures['drafting_ms_per_round']} ms; "
          f"fixed width {args.width} x{figures['fixed_over_plain']} (acceptance {figures['acceptance_length']}); "
          f"oracle x{figures['oracle_over_plain']}, with free drafting x{figures['oracle_free_drafting_over_plain']}",
          flush=True)
    return figures


if __name__ == "__main__":
    main()
