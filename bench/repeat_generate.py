"""The same `lucebox generate` command run several times in a row, each in its own process, as a
user would: how much its decode speed varies from run to run (a width policy that switched
drafting off by chance would show as a run several times slower than the others).

    python bench/repeat_generate.py                       # 6 runs each: the default drafter, n-gram, none
    python bench/repeat_generate.py --out bench/results   # replace the committed result

Before the timed runs, `--warmup` untimed rounds of every command run first (reported, not counted),
as hyperfine does: the first processes after an idle stretch decode up to 20% slower on this
machine while its caches and clocks warm up, whichever drafter they use.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402

PROMPT = "def parse_header(line):"
DRAFTS = {"default (auto)": [], "ngram": ["--draft", "ngram"], "none": ["--no-draft"]}


def one_run(extra: list[str], tokens: int) -> dict:
    command = [sys.executable, "-m", "lucebox.cli", "generate", "--prompt", PROMPT, "--max-tokens", str(tokens),
               "--temp", "0", "--stats", *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    out = done.stdout + done.stderr  # --stats prints its line to stderr
    speed = float(re.search(r"decode ([0-9.]+) tok/s", out).group(1))
    acceptance = re.search(r"acceptance ([0-9.]+)", out)
    return {"decode_tokens_per_s": speed, "acceptance": float(acceptance.group(1)) if acceptance else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of every command first (default 1)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()
    warmup = {}
    for _ in range(args.warmup):
        for name, extra in DRAFTS.items():
            warmup.setdefault(name, []).append(one_run(extra, args.tokens)["decode_tokens_per_s"])
    results = {}
    for _ in range(args.runs):  # interleaved, so a slow stretch of the machine touches every drafter
        for name, extra in DRAFTS.items():
            results.setdefault(name, []).append(one_run(extra, args.tokens))
    summary = {}
    for name, runs in results.items():
        speeds = [r["decode_tokens_per_s"] for r in runs]
        summary[name] = {"warmup_decode_tokens_per_s": warmup.get(name, []), "runs": runs,
                         "min": min(speeds), "max": max(speeds),
                         "max_over_min": round(max(speeds) / min(speeds), 3),
                         "acceptance": sorted({r["acceptance"] for r in runs if r["acceptance"] is not None})}
        print(f"{name:16s} decode tok/s {' '.join(f'{s:.0f}' for s in speeds)}  max/min {max(speeds) / min(speeds):.2f}"
              f"  acceptance {summary[name]['acceptance']}", flush=True)
    path = write_result("repeat_generate", {"prompt": PROMPT, "tokens": args.tokens, "warmup_rounds": args.warmup,
                                                 "results": summary}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
