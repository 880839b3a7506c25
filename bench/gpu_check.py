"""The first minutes on a GPU: what must hold, and what the card does, in one JSON record.

    bash bench/gpu_check.sh                         # on the GPU: each section in its own process, time-boxed
    bash bench/gpu_check.sh --dry-run               # every section on the CPU at tiny shapes

Sections, in order (`SECTIONS`): the environment (and whether the carried Triton cache can hit,
bench/triton_cache.py); correctness, about a minute (Laguna XS.2 cut to four layers, int4, over a
select pool that offloads: graphed == eager, n-gram speculation == plain, and the same tokens with
CUDA_LAUNCH_BLOCKING=1, so a race between the copy stream and compute shows); the CUDA graph tests
(each its own pytest process and time-out); Laguna XS.2 int4 with dummy weights under a 24 GiB
budget (load, first request, decode tokens/s at 1K/32K/128K, peak memory); the kernel table (every
Triton call of the XS.2 decode step timed beside its prediction in bench/results/roofline-kernels.json);
a drafter check (the built-in model's speculation gives plain decoding's output, its acceptance and
speed); the step's profile (`bench/gpu_step_profile.py`). Each section merges its result into one
JSON file (`gpu-check.json`) as soon as it has one and prints it to its log, so a section cut short
by its time box keeps what it measured and its log; each records `cache_misses`, the kernels it
compiled that the carried cache did not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
XS2 = ROOT / "examples" / "laguna-xs2"

from bench import triton_cache  # noqa: E402
from bench.gpu_step_profile import step_profile  # noqa: E402


class Check:
    """Where a run writes, and whether it is the CPU dry run."""

    def __init__(self, out: Path, dry: bool):
        self.out, self.dry = out, dry
        self.path = out / "gpu-check.json"
        self.logs = out / "gpu-check-logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def record(self, section: str, **fields) -> None:
        """Merge `fields` into the section's entry of the JSON file (read, update, rewrite)."""
        data = json.loads(self.path.read_text()) if self.path.exists() else {}
        data.setdefault("sections", {}).setdefault(section, {}).update(fields)
        self.path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(json.dumps({section: fields}, default=str)[:2000], flush=True)  # the section's log, as it goes

    @property
    def cuda(self) -> bool:
        import torch

        return not self.dry and torch.cuda.is_available()

    def python(self, args: list[str], log: str, env: dict | None = None, timeout: float | None = None) -> Ran:
        """This Python on `args` from the checkout's root, its output streamed into logs/`log` as it
        runs (a child killed at `timeout` seconds, or with its parent, leaves what it had printed)."""
        path = self.logs / log
        with path.open("w") as out:
            child = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
            try:
                returncode = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                returncode = None
        return Ran(returncode, path.read_text(errors="replace"))


class Ran:
    """A child's exit status (None: killed at its time-out) and its whole log."""

    def __init__(self, returncode: int | None, output: str):
        self.returncode, self.output = returncode, output

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def environment(check: Check) -> dict:
    import torch
    import triton

    from lucebox.benchmark.record import commit

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda_runtime": torch.version.cuda,
            "python": sys.version.split()[0], "commit": commit(), "cuda_available": torch.cuda.is_available(),
            "triton_cache": cache_check()}
    if not check.cuda:
        return {**info, "gpu": None, "note": "no CUDA device (dry run)" if check.dry else "no CUDA device"}
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {**info, "gpu": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "driver": smi.stdout.strip() or smi.stderr.strip()}


# The CUDA graph tests, each its own pytest process under its own time-out (seconds), recorded as it
# finishes. tests/test_kernels.py is left out: its shapes are not in the carried cache, and compiling
# them cold takes longer than this run has.
GRAPH_TESTS = {
    "tests/test_cuda_graphs.py::test_every_width_replays_the_uncaptured_steps_logits_on_cuda": 20,
    "tests/test_cuda_graphs.py::test_replayed_graphs_equal_the_uncaptured_step_on_cuda": 30,
    "tests/test_cuda_graphs.py::test_the_drafters_replayed_block_pass_equals_its_eager_pass_on_cuda": 15,
    "tests/test_mtp_graph.py::test_the_replayed_head_pass_drafts_as_the_eager_one_on_cuda": 60,
}


def cache_check() -> dict:
    """Whether this machine's Triton hits TRITON_CACHE_DIR's kernels (bench/triton_cache.py)."""
    folder = os.environ.get("TRITON_CACHE_DIR")
    if not folder:
        return {"usable": False, "reason": "TRITON_CACHE_DIR is not set"}
    return {"folder": folder, **triton_cache.check(Path(folder))}


def cache_entries() -> int | None:
    folder = os.environ.get("TRITON_CACHE_DIR")
    return len(triton_cache.entries(Path(folder))) if folder and Path(folder).is_dir() else None


def graph_tests(check: Check) -> dict:
    import importlib.util

    if not check.cuda:
        return {"status": "skipped", "reason": "needs CUDA: real graph capture and the bf16 kernels"}
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not installed on this machine"}
    results = {}
    for test, seconds in GRAPH_TESTS.items():
        name = test.rpartition("::")[2]
        ran = check.python(["-m", "pytest", "-q", "-x", test], f"graph_tests-{name}.log", timeout=seconds)
        results[name] = {"status": "timed_out" if ran.timed_out else "ok" if ran.returncode == 0 else "failed",
                         "timeout_s": seconds, "summary": ran.output.strip().splitlines()[-1:]}
        check.record("graph_tests", tests=results)
    return {"status": "ok" if all(r["status"] == "ok" for r in results.values()) else "failed"}


def laguna_xs2(check: Check) -> dict:
    """Load, first request (compiles, graph captures), then decode at each context; each row is
    recorded as soon as it is measured."""
    import torch

    from bench.kernels import bench_contexts, contexts_llm, decode_bytes_per_token, dry_run_model

    device = torch.device("cuda" if check.cuda else "cpu")
    folder, dtype, vram = (XS2, torch.bfloat16, "24GiB") if check.cuda else (dry_run_model(), torch.float32, None)
    contexts, tokens = ([1024, 32768, 131072], 64) if check.cuda else ([64, 128], 3)
    check.record("laguna_xs2", model=str(folder), dtype=str(dtype), vram_budget=vram, contexts=contexts)
    first_prompt = list(range(3, 131))
    start = time.perf_counter()
    llm = contexts_llm(folder, dtype, device, max(*contexts, len(first_prompt) + 8) + tokens + 1, vram)
    check.record("laguna_xs2", load_s=time.perf_counter() - start, backend=llm.setup.backend)
    start = time.perf_counter()
    llm.generate(first_prompt, max_tokens=8, ignore_eos=True)
    check.record("laguna_xs2", first_request_s=time.perf_counter() - start)
    rows = []
    for context in contexts:
        row = bench_contexts(folder, dtype, device, [context], tokens, vram, llm=llm)[0]
        row["bytes_per_token"] = decode_bytes_per_token(llm, context)
        row["achieved_gb_per_s"] = row["decode_tokens_per_s"] * row["bytes_per_token"] / 1e9
        rows.append(row)
        check.record("laguna_xs2", decode=rows)
    peak = torch.cuda.max_memory_allocated(device) if check.cuda else None
    return {"status": "ok", "peak_device_bytes": peak}


ROOFLINE_KERNELS = ROOT / "bench" / "results" / "roofline-kernels.json"
CARDS = {"3090": "rtx3090", "4090": "rtx4090", "H100": "h100", "H200": "h200"}  # device name part -> table key


def kernel_table(check: Check) -> dict:
    """Each Triton kernel call of the XS.2 int4 decode step (`bench/roofline_kernels.py` decode_calls)
    timed at 1, 4 and 16 rows, beside the committed roofline table's prediction for this card: one
    row recorded as soon as it is measured. Inputs rotate over copies beyond the L2 cache (CUDA)."""
    import torch

    from bench.kernels import Timer
    from bench.roofline_kernels import decode_calls

    table = json.loads(ROOFLINE_KERNELS.read_text())["kernels"]
    name = torch.cuda.get_device_name(0) if check.cuda else ""
    card = next((key for part, key in CARDS.items() if part in name), None)
    device = torch.device("cuda" if check.cuda else "cpu")
    dtype = torch.bfloat16 if check.cuda else torch.float32
    # The dry run times one cheap call through the interpreter: it checks the code path, not the card.
    rows_list, contexts, copies = ((1, 4, 16), (1024, 32768, 131072), 8) if check.cuda else ((1,), (1024,), 1)
    timer, measured = Timer(device, 10 if check.cuda else 1), []
    for rows in rows_list:
        sets = [decode_calls(device, dtype, rows, contexts, None if check.cuda else 8) for _ in range(copies)]
        for position, call in enumerate(sets[0]):
            if not check.cuda and call.name != "route":
                continue
            seconds = timer([calls[position].run for calls in sets])
            same = [r for r in table if (r["call"], r["rows"], r["context"]) == (call.name, rows, call.context)]
            predicted = [r.get("predicted", {}).get(card or "rtx3090", {}).get("seconds") for r in same]
            model = sum(predicted) if predicted and None not in predicted else None
            measured.append({"call": call.name, "rows": rows, "context": call.context, "measured_us": seconds * 1e6,
                             "predicted_us": model * 1e6 if model else None, "launches": len(predicted),
                             "measured_over_predicted": seconds / model if model else None})
            check.record("kernel_table", card=card, rows=measured)
        del sets
    return {"status": "ok", "card": card, "table": str(ROOFLINE_KERNELS.relative_to(ROOT)),
            **({} if check.cuda else {"note": "no CUDA: one call through the interpreter, against the rtx3090 row"})}


def race_model(check: Check) -> Path:
    """Laguna XS.2 cut to four layers (every width real, one load in seconds); the dry run's tiny model."""
    from bench.kernels import dry_run_model

    if check.dry:
        return dry_run_model()
    config = json.loads((XS2 / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config = {k: v[:4] if isinstance(v, list) and len(v) == layers else v for k, v in config.items()}
    folder = Path(tempfile.mkdtemp()) / "laguna-xs2-4-layers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return folder


# The correctness runs' cache: a select pool of 640 tokens under a 1,400-token prompt, so chunks leave
# the pool for the host and come back (the copy stream runs) while graphs replay.
OFFLOADING = dict(max_context=2048, kv_policy="select", kv_pool_tokens=640, prefill_chunk=256)
PROMPT_TOKENS = 1400
# name -> LLM options of one greedy run; every run must give the "graphs" run's tokens.
GREEDY_RUNS = {
    "graphs": {},  # the default: graphed steps on CUDA
    "eager": {"cuda_graphs": False},
    "speculative": {"draft": "ngram", "draft_k": 7, "adaptive": False},  # verify blocks of up to 8 rows
}


def greedy_runs(folder: str, tokens: int, names: list[str]) -> None:
    """Print one JSON line per run as it finishes (int4, the default backend, the offloading pool):
    a run cut short by its time-out keeps the lines before it."""
    import torch

    import lucebox

    cuda = torch.cuda.is_available()
    for name in names:
        start = time.perf_counter()
        llm = lucebox.LLM(folder, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                          load_format="dummy", quantization="int4", **OFFLOADING, **GREEDY_RUNS[name])
        # A repeated stretch: n-gram drafts find matches, so verify blocks wider than one row run.
        stretch = torch.randint(3, llm.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
        prompt = stretch.repeat(PROMPT_TOKENS // 200).tolist()
        out = llm.generate(prompt, max_tokens=tokens, ignore_eos=True)
        print(json.dumps({"run": name, "tokens": out.token_ids, "seconds": time.perf_counter() - start,
                          "graphed": bool(llm.engine.runner.graphs), "rounds": out.stats.get("rounds"),
                          "acceptance_length": out.stats.get("acceptance_length")}), flush=True)


def correctness(check: Check) -> dict:
    """The first minute: graphed == eager, speculation == plain (int4, compiled kernels), and the
    same tokens with CUDA_LAUNCH_BLOCKING=1 (a race between the copy stream and compute would change
    them), all over a pool that offloads. Each child has its own time-out; each run is recorded as it ends."""
    folder, tokens = str(race_model(check)), (48 if check.cuda else 4)
    children = {"blocking0": ("0", list(GREEDY_RUNS), 40), "blocking1": ("1", ["graphs"], 20)}
    runs = {}
    for child, (blocking, names, seconds) in children.items():
        env = {"CUDA_LAUNCH_BLOCKING": blocking, **({"CUDA_VISIBLE_DEVICES": ""} if check.dry else {})}
        ran = check.python([__file__, "--greedy-runs", folder, str(tokens), *names], f"correctness-{child}.log", env,
                           timeout=seconds * (1 if check.cuda else 6))  # the CPU's interpreter is slower
        for line in ran.output.splitlines():
            if line.startswith('{"run"'):
                row = json.loads(line)
                runs[f"{row.pop('run')}-{child}"] = row
        missing = [name for name in names if f"{name}-{child}" not in runs]
        runs.update({f"{name}-{child}": {"status": "timed_out" if ran.timed_out else "failed"} for name in missing})
        check.record("correctness", runs=runs)
    want = runs["graphs-blocking0"].get("tokens")
    same = {name: want is not None and run.get("tokens") == want for name, run in runs.items()}
    return {"status": "ok" if all(same.values()) else "failed", "identical_to_graphs": same, "tokens": tokens,
            "cache": {**OFFLOADING, "prompt_tokens": PROMPT_TOKENS,
                      "offloads": PROMPT_TOKENS > OFFLOADING["kv_pool_tokens"]},
            **({} if check.cuda else {"note": "no CUDA: eager runs, nothing races; checks the code path only"})}


def drafter(check: Check) -> dict:
    """The built-in model with and without its paired DFlash drafter: greedy output must be equal."""
    import lucebox
    from bench.speculative import prompts_from_held_out
    from lucebox.builtin import builtin_model

    common = dict(device="cuda" if check.cuda else "cpu", dtype="float32")
    plain, spec = lucebox.LLM(builtin_model(), draft=None, **common), lucebox.LLM(builtin_model(), **common)
    count, length, tokens = (4, 128, 128) if check.cuda else (1, 24, 8)
    # Held-out standard-library files, or (a Python without them) one fixed snippet
    prompts = [ids for _, ids in prompts_from_held_out(plain.tokenizer, count, length)] or \
        [plain.tokenizer.encode(FALLBACK_PROMPT * 8)[:length]]
    for llm in (plain, spec) if check.cuda else ():  # warm-up: compiles and graph captures stay out of the speeds
        llm.generate(prompts[0][:16], max_tokens=4, ignore_eos=True)
    runs = {name: [llm.generate(p, max_tokens=tokens, ignore_eos=True) for p in prompts]
            for name, llm in (("plain", plain), ("speculative", spec))}

    def speed(gens) -> float:
        return sum(g.stats["generated_tokens"] - 1 for g in gens) / sum(g.stats["decode_time_s"] for g in gens)

    rounds = sum(g.stats["rounds"] for g in runs["speculative"])
    committed = sum(g.stats["acceptance_length"] * g.stats["rounds"] for g in runs["speculative"])
    same = all(a.token_ids == b.token_ids for a, b in zip(runs["plain"], runs["speculative"], strict=True))
    return {"status": "ok" if same else "failed", "identical": same, "prompts": len(prompts), "tokens": tokens,
            "proposer": type(spec.proposer).__name__,
            "acceptance_length": committed / rounds if rounds else 0.0,
            "plain_tokens_per_s": speed(runs["plain"]), "speculative_tokens_per_s": speed(runs["speculative"])}


FALLBACK_PROMPT = "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"


# name -> (section, seconds its process may run on the GPU). The .sh runs them in this order.
SECTIONS = {
    "environment": (environment, 20),  # hashing the Triton wheel for the cache check takes seconds
    "correctness": (correctness, 70),
    "graph_tests": (graph_tests, 70),
    "laguna_xs2": (laguna_xs2, 160),
    "kernel_table": (kernel_table, 60),
    "drafter": (drafter, 40),
    "step_profile": (step_profile, 40),
}


def run_section(check: Check, name: str) -> bool:
    check.record(name, status="started", dry_run=check.dry)
    if os.environ.get("STALL_SECTION") == name:  # tests: a section that surely outlives its time box
        time.sleep(3600)
    start, compiled = time.perf_counter(), cache_entries()
    try:
        result = SECTIONS[name][0](check)
    except Exception as e:  # noqa: BLE001 - the record says what failed; later sections still run
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    after = cache_entries()
    # Kernels compiled here, not found in the carried cache (misses); None without a cache folder.
    misses = after - compiled if compiled is not None and after is not None else None
    result = {"status": "ok", **result, "seconds": time.perf_counter() - start, "cache_misses": misses}
    check.record(name, **result)
    return result["status"] in ("ok", "skipped")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory of gpu-check.json and its logs")
    p.add_argument("--section", choices=list(SECTIONS), help="run this section only (default: all, in order)")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes")
    p.add_argument("--list", action="store_true", help="print each section's name and time box, for the .sh")
    p.add_argument("--only", default=None, help="with --list: these sections (comma-separated)")
    p.add_argument("--timed-out", metavar="SECTION", help="record that SECTION's process ran out of time")
    p.add_argument("--greedy-runs", nargs="+", metavar="FOLDER N RUN", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.list:
        names = args.only.split(",") if args.only else list(SECTIONS)
        unknown = [name for name in names if name not in SECTIONS]
        if unknown:
            p.error(f"unknown sections {unknown}; there are {list(SECTIONS)}")
        seconds = {name: int(os.environ.get("TIME_BOX", SECTIONS[name][1])) for name in names}  # TIME_BOX: tests
        print("\n".join(f"{name} {seconds[name]}" for name in names))
        return
    if args.dry_run or not _has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    if args.greedy_runs:
        greedy_runs(args.greedy_runs[0], int(args.greedy_runs[1]), args.greedy_runs[2:])
        return
    check = Check(Path(args.out), args.dry_run)
    if args.timed_out:
        check.record(args.timed_out, status="timed_out", seconds=SECTIONS[args.timed_out][1])
        return
    ok = [run_section(check, name) for name in ([args.section] if args.section else SECTIONS)]
    sys.exit(0 if all(ok) else 1)


def _has_cuda() -> bool:
    return os.environ.get("CUDA_VISIBLE_DEVICES") != "" and Path("/dev/nvidiactl").exists()


if __name__ == "__main__":
    main()
