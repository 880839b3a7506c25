"""Many clients on one engine, the figures issue 41 asks for, side by side in one run (the built-in
model, greedy, `lucebox.benchmark.concurrency`):

- aggregate tokens/s at 1, 2, 4 and 8 clients at once, speculation off and on (the default drafter);
- time to first token p50/p95 of short requests, 4 at once against one alone;
- one client alone against the same measure on another checkout (`--baseline DIR`, e.g. a
  `git worktree` of the commit before batching), each in fresh processes, alternated.

    python bench/concurrency.py --out bench/results
    python bench/concurrency.py --baseline /tmp/before --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402

ONE_CLIENT = """
import json, sys, time, torch
import lucebox
llm = lucebox.LLM(draft=None)
prompt = "def parse_header(line):\\n"
llm.generate(prompt, max_tokens=8)
best = 0.0
for _ in range(int(sys.argv[2])):
    start = time.perf_counter()
    out = llm.generate(prompt, max_tokens=int(sys.argv[1]), ignore_eos=True)
    best = max(best, len(out.token_ids) / (time.perf_counter() - start))
print(json.dumps({"tokens_per_s": best}))
"""


def one_client(tree: Path, gen: int, repeat: int) -> float:
    """Plain decoding tokens/s of one client alone, best of `repeat`, in a fresh process importing
    lucebox from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", ONE_CLIENT, str(gen), str(repeat)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--gen", type=int, default=64, help="tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", type=Path, default=None, help="a checkout to compare one client alone with")
    p.add_argument("--pairs", type=int, default=4, help="alternated process pairs for the baseline comparison")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import lucebox
    from lucebox.benchmark.concurrency import measure, one_round, summary

    clients = sorted({1, 4, *(int(c) for c in args.clients.split(","))})  # the ratios compare 4 with 1
    llm = lucebox.LLM(parallel=max(clients))
    rows = measure(llm, clients, args.gen, args.rounds, [False, True], lambda line: print(line, file=sys.stderr))
    by = {(r["speculation"], r["clients"]): r for r in rows}
    short_rounds: dict[int, list] = {1: [], 4: []}
    for _ in range(max(args.rounds, 5)):  # short requests (2 tokens: the first is the prefill's), interleaved
        for n in short_rounds:
            short_rounds[n].append(one_round(llm, n, 2, False))
    short = {n: summary(rounds) for n, rounds in short_rounds.items()}
    plain = {n: by[(False, n)]["aggregate_tokens_per_s"] for n in clients}
    figures = {
        "plain_4_clients_x_1_client": plain[4] / plain[1],
        "speculation_4_clients_x_plain_4_clients":
            by[(True, 4)]["aggregate_tokens_per_s"] / by[(False, 4)]["aggregate_tokens_per_s"],
        "short_requests_ttft_p95_4_at_once_x_alone_p50": short[4]["ttft_p95_s"] / short[1]["ttft_p50_s"],
    }
    baseline = None
    if args.baseline is not None:
        pairs = [(one_client(ROOT, args.gen, 3), one_client(args.baseline, args.gen, 3)) for _ in range(args.pairs)]
        baseline = {"tree": str(args.baseline), "pairs_tokens_per_s": pairs}
        figures["one_client_x_baseline"] = statistics.median(now / before for now, before in pairs)
    for name, value in figures.items():
        print(f"{name}: {value:.2f}")
    path = write_result("concurrency", {"model": "laguna-code-6m (built-in)", "gen": args.gen, "rounds": args.rounds,
                                        "figures": figures, "rows": rows, "short_requests": short,
                                        "baseline": baseline}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
