"""The same benchmarks on two checkouts of lucebox, taking turns, for a change that should leave the
figures as they were (a refactor): each round runs every benchmark on `--before` and on this
checkout, in alternating order (ABBA...), so the machine's drift falls on both alike.

    python bench/side_by_side.py --before ../lucebox-old --rounds 2 --out bench/results

`--before` is another checkout with its own venv (`.venv/bin/python`, or `--before-python`). Each
figure is the median of its rounds, beside the ratio after / before. A fixed-width greedy row's
acceptance length is deterministic (no width chosen by time): equal on both is checked and recorded
(`same_greedy_acceptance`).

Benchmarks: `bench/speculative.py` (every drafter row, greedy and sampled), `bench/verify_rows.py`
(a step's cost by its rows) and `lucebox bench --quick` (prefill, decode, speculative decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402

SPECULATIVE = ["bench/speculative.py", "--prompts", "4", "--repeats", "1"]
VERIFY_ROWS = ["bench/verify_rows.py"]
QUICK = ["-m", "lucebox.cli", "bench", "--quick"]


def _run(python: Path, checkout: Path, name: str, out: Path) -> dict[str, float]:
    """One benchmark on one checkout -> its figures by name."""
    if name == "bench_quick":
        command = [str(python), *QUICK, "--json", str(out / "quick.json")]
    else:
        command = [str(python), *(SPECULATIVE if name == "speculative" else VERIFY_ROWS), "--out", str(out)]
    subprocess.run(command, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    return _figures(name, out)


def _figures(name: str, out: Path) -> dict[str, float]:
    if name == "bench_quick":
        record = json.loads((out / "quick.json").read_text())
        return {f"{key} @{row['depth']}": row[key] for row in record["rows"]
                for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "spec_decode_tokens_per_s",
                            "acceptance_length")}
    record = json.loads(next(out.glob(f"{name}-*.json")).read_text())
    if name == "verify_rows":
        return {f"step ms, {step['rows']} rows": step["ms"] for step in record["steps"]}
    figures = {}
    for row, result in record["results"].items():
        figures[f"{row}: decode tok/s"] = result["decode_tokens_per_s"]
        figures[f"{row}: acceptance length"] = result["acceptance_length"]
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, type=Path, help="the other checkout")
    p.add_argument("--before-python", type=Path, default=None, help="its python (default: its .venv)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--benchmarks", default="speculative,verify_rows,bench_quick")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()
    sides = {"before": (args.before_python or args.before / ".venv" / "bin" / "python", args.before.resolve()),
             "after": (Path(sys.executable), ROOT)}
    runs: dict[str, dict[str, list[dict]]] = {}
    for i in range(args.rounds):
        for name in args.benchmarks.split(","):
            for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                with tempfile.TemporaryDirectory() as scratch:
                    figures = _run(*sides[side], name, Path(scratch))
                runs.setdefault(name, {}).setdefault(side, []).append(figures)
                print(f"round {i + 1}: {name} on {side} done", file=sys.stderr)
    write_result("side_by_side", {"before": str(args.before.resolve()), "before_commit": _commit(args.before),
                                  "rounds": args.rounds, "results": _summary(runs)}, args.out)


def _summary(runs: dict[str, dict[str, list[dict]]]) -> dict:
    summary = {}
    for name, sides in runs.items():
        rows = {}
        for figure in sides["after"][0]:
            before = statistics.median(run[figure] for run in sides["before"])
            after = statistics.median(run[figure] for run in sides["after"])
            rows[figure] = {"before": before, "after": after, "after_over_before": after / before if before else None}
        # fixed-width greedy rows choose no width by time: their acceptance is the tokens' own
        greedy = [f for f in rows if "fixed" in f and "greedy: acceptance" in f]
        summary[name] = {"figures": rows, "same_greedy_acceptance": all(
            rows[f]["before"] == rows[f]["after"] for f in greedy) if greedy else None}
    return summary


def _commit(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
