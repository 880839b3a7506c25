"""`lucebox bench [MODEL]`: prefill and decode speed (plain and speculative) by context depth.

    lucebox bench --quick                                  # the built-in model at 1k, 2k, 3k: < 3 min on a CPU
    lucebox bench MODEL --depths 1k,4k,16k,64k --json r.json --plot r.png
    lucebox bench --compare before.json after.json         # B / A for every figure, by depth
    lucebox bench --concurrency 1,2,4,8 --json c.json      # many clients at once: aggregate tokens/s, TTFT

Each request prefills a depth-long prompt from an empty cache, then decodes --gen tokens; the engines
are opened for the deepest depth + --gen tokens unless --ctx says otherwise.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from lucebox.engine_flags import add_engine_flags, engine_config
from lucebox.errors import InvalidArgumentError

# 3k, not 4k: 4k + 64 generated tokens would run past the 4096 positions the built-in model was trained for
QUICK = {"depths": "1k,2k,3k", "gen": 64, "repeat": 3}
DEFAULTS = {"gen": 128, "repeat": 3}
SUFFIXES = {"": 1, "k": 1024, "m": 1024 * 1024}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p)
    p.add_argument("--depths", default=None,
                   help="context depths, e.g. 1k,4k,16k,64k,256k or 512,2048 (default: that ladder, cut to what "
                        "fits memory; on a CPU at most 16k)")
    p.add_argument("--gen", type=int, default=None, help=f"tokens decoded per request (default {DEFAULTS['gen']})")
    p.add_argument("--repeat", type=int, default=None,
                   help="requests per depth and engine; rows show the median and min-max "
                        f"(default {DEFAULTS['repeat']})")
    p.add_argument("--prompt", choices=("auto", "code", "random"), default="auto",
                   help="what prompts are cut from: code (the held-out standard-library modules, concatenated: "
                        "text the built-in model never saw), random token ids, or auto: code when the model has a "
                        "tokenizer (default: auto)")
    p.add_argument("--prompt-file", default=None, help="a text file tokenized and tiled to each depth "
                                                        "(default: --prompt)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    p.add_argument("--quick", action="store_true",
                   help=f"depths {QUICK['depths']}, --gen {QUICK['gen']}, --repeat {QUICK['repeat']} "
                        "(flags given beside it win)")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON")
    p.add_argument("--csv", metavar="FILE", help="write the rows as CSV")
    p.add_argument("--md", metavar="FILE", help="write the rows as a Markdown table")
    p.add_argument("--plot", metavar="FILE.png", help="plot tokens/s against depth (needs matplotlib: "
                                                      "pip install 'lucebox[plot]')")
    p.add_argument("--overwrite", action="store_true",
                   help="let --json, --csv, --md and --plot replace files that exist; without it such a file is "
                        "refused before the run")
    p.add_argument("--concurrency", default=None, metavar="N,N,...",
                   help="instead of depths: clients streaming at once from one engine opened with that many "
                        "slots (--gen tokens each, --repeat rounds interleaved), with speculation on and off; "
                        "reports aggregate and per-request tokens/s and time to first token p50/p95 (--json only)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print B / A for each figure of two results, by depth (loads no model)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="long-context benchmark: prefill and decode speed by context depth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)


def parse_depths(text: str) -> tuple[int, ...]:
    """"1k,4k,256k" -> (1024, 4096, 262144); plain token counts too. Sorted, without repeats."""
    depths = set()
    for word in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", word)
        value = int(match[1]) * SUFFIXES[match[2].lower()] if match else 0
        if value <= 0:
            raise InvalidArgumentError(f"--depths: '{word.strip()}' is not a positive token count; "
                                       "write e.g. --depths 1k,4k,16k or --depths 512,2048")
        depths.add(value)
    return tuple(sorted(depths))


def settings_from(args: argparse.Namespace):
    """The `BenchSettings` the flags describe (--quick fills in what was not given)."""
    from lucebox.benchmark.runner import BenchSettings, read_prompt_file

    preset = QUICK if args.quick else {}
    depths = args.depths or preset.get("depths")
    gen = args.gen if args.gen is not None else preset.get("gen", DEFAULTS["gen"])
    repeat = args.repeat if args.repeat is not None else preset.get("repeat", DEFAULTS["repeat"])
    if gen < 2:
        raise InvalidArgumentError(f"--gen must be at least 2 (the first token comes from the prefill), got {gen}")
    if repeat < 1:
        raise InvalidArgumentError(f"--repeat must be at least 1, got {repeat}")
    prompt_file = prompt_text = None
    if args.prompt_file is not None:  # read now: a bad file is refused before the model loads
        prompt_file, prompt_text = Path(args.prompt_file), read_prompt_file(args.prompt_file)
    return BenchSettings(depths=parse_depths(depths) if depths else None, gen=gen, repeat=repeat,
                         prompt_file=prompt_file, prompt_text=prompt_text, prompt=args.prompt, seed=args.seed)


class _FlagRecorder(argparse.ArgumentParser):
    """A parser that keeps, in order, the Action each add_argument call returns (argparse lists them only
    in a private attribute)."""

    def __init__(self) -> None:
        super().__init__(add_help=False)
        self.recorded: list[argparse.Action] = []

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.recorded.append(action)
        return action


def equivalent_command(args: argparse.Namespace) -> str:
    """The command line that repeats this run: `lucebox bench` and every flag not at its default."""
    p = _FlagRecorder()
    _add_arguments(p)
    words = ["lucebox", "bench"]
    written = set()
    for action in p.recorded:
        value = getattr(args, action.dest, action.default)
        if value == action.default or action.dest in written:  # --no-draft: --draft none says it
            continue
        written.add(action.dest)
        if not action.option_strings:
            words.append(str(value))
        elif isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag: the value picks one
            words.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # a switch (store_true): the flag alone sets it
            words.append(action.option_strings[-1])
        else:
            words += [action.option_strings[-1], *map(str, value if isinstance(value, list) else [value])]
    return shlex.join(words)


def command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lucebox.benchmark import report
    from lucebox.benchmark.outputs import planned_outputs, write_outputs

    out = Console(highlight=False)
    if not out.is_terminal:
        out.width = 160  # a file or a pipe: no terminal to fit, so keep each row on one line
    if args.compare:
        a, b = (report.load_result(path) for path in args.compare)
        out.print(report.compare_table(a, b, *args.compare))
        return 0
    if args.concurrency is not None:
        return concurrency_command(args, out)
    # Everything the run will need is checked before it starts: a run of hours never ends in a refusal.
    settings = settings_from(args)
    planned = planned_outputs(args, reads=(args.prompt_file,) if args.prompt_file else ())
    if args.plot:
        from lucebox.benchmark.plot import require_matplotlib

        require_matplotlib()
    result = measure(args, settings)
    out.print(report.table(result))
    for problem in report.problems(result):  # never expected: a figure that is not a positive finite number
        print(f"lucebox: warning: {problem}", file=sys.stderr)
    written = write_outputs(result, planned, args.overwrite)
    if written:
        print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


def measure(args: argparse.Namespace, settings) -> dict:
    """Run the benchmark and wrap its rows in the record of the run."""
    from lucebox import __version__
    from lucebox.benchmark.progress import bench_progress
    from lucebox.benchmark.record import commit, machine, utc_now
    from lucebox.benchmark.report import SCHEMA
    from lucebox.benchmark.runner import run_benchmark

    started = utc_now()
    with bench_progress() as progress:
        measured = run_benchmark(engine_config(args), settings, progress)
    return {"schema": SCHEMA, "date": started, "commit": commit(), "lucebox": __version__,
            "command": equivalent_command(args), "machine": machine(), **measured}



def parse_counts(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8]: client counts, sorted, without repeats, each 1..PARALLEL_MAX."""
    from lucebox.limits import PARALLEL_MAX

    counts = set()
    for word in text.split(","):
        value = int(word) if word.strip().isdigit() else 0
        if not 1 <= value <= PARALLEL_MAX:
            raise InvalidArgumentError(f"--concurrency: '{word.strip()}' is not a client count from 1 to "
                                       f"{PARALLEL_MAX}; write e.g. --concurrency 1,2,4,8")
        counts.add(value)
    return sorted(counts)


def concurrency_command(args: argparse.Namespace, out) -> int:
    """`lucebox bench --concurrency`: `benchmark.concurrency.measure` on one engine with a slot per client."""
    import json

    from lucebox import LLM, __version__
    from lucebox.benchmark.concurrency import measure as measure_concurrency
    from lucebox.benchmark.outputs import planned_outputs
    from lucebox.benchmark.record import commit, machine, utc_now

    counts = parse_counts(args.concurrency)
    refused = [f"--{flag}" for flag in ("csv", "md", "plot", "depths", "prompt_file") if getattr(args, flag, None)]
    if refused:
        raise InvalidArgumentError(f"--concurrency writes --json only and reads no depths or prompt file; drop "
                                   f"{', '.join(refused)}")
    planned = planned_outputs(args)
    gen = args.gen if args.gen is not None else DEFAULTS["gen"]
    rounds = args.repeat if args.repeat is not None else DEFAULTS["repeat"]
    started = utc_now()
    llm = LLM.from_config(engine_config(args, parallel=max(counts)))
    speculation = [False, True] if llm.proposer is not None else [False]
    rows = measure_concurrency(llm, counts, gen, rounds, speculation,
                               lambda line: print(f"\r{line:<80}", end="", file=sys.stderr, flush=True))
    print(file=sys.stderr)
    out.print(concurrency_table(rows))
    result = {"benchmark": "concurrency", "date": started, "commit": commit(), "lucebox": __version__,
              "command": equivalent_command(args), "machine": machine(), "gen": gen, "rounds": rounds, "rows": rows}
    if "json" in planned:
        planned["json"].write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {planned['json']}", file=sys.stderr)
    return 0


def concurrency_table(rows: list[dict]):
    from rich.table import Table

    table = Table(title="clients at once on one engine")
    for name in ("speculation", "clients", "aggregate tok/s", "x 1 client", "per request tok/s", "TTFT p50 ms",
                 "TTFT p95 ms"):
        table.add_column(name, justify="right")
    one = {row["speculation"]: row["aggregate_tokens_per_s"] for row in rows if row["clients"] == min(
        r["clients"] for r in rows)}
    for row in rows:
        per_request = row["request_decode_tokens_per_s"]
        aggregate = row["aggregate_tokens_per_s"]
        table.add_row("on" if row["speculation"] else "off", str(row["clients"]),
                      f"{aggregate:.1f}", f"{aggregate / one[row['speculation']]:.2f}",
                      "-" if per_request is None else f"{per_request:.1f}",
                      f"{1e3 * row['ttft_p50_s']:.1f}", f"{1e3 * row['ttft_p95_s']:.1f}")
    return table
