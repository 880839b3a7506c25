"""The first ten minutes on a GPU: what must hold, and what the card does, in one JSON record.

    bench/gpu_check.sh                              # on the GPU: each section in its own process, time-boxed
    python bench/gpu_check.py --dry-run --out DIR   # every section on the CPU at tiny shapes

Sections, in order (`SECTIONS`): the environment; the graph capture/replay and kernel tests;
Laguna XS.2 int4 with dummy weights under a 24 GiB budget (load, first request, decode tokens/s at
1K/32K/128K of context, peak memory); a stream race check (the same greedy tokens with and without
CUDA_LAUNCH_BLOCKING=1); a drafter check (speculation gives plain decoding's output, its acceptance
and speed); the step's profile (`bench/gpu_step_profile.py`: kernels per step, verify-8 over
decode-1 on the bound cache, per-kernel bandwidth). Each section merges its result into one JSON
file (`gpu-check.json`) as soon as it has one, partial results included, so a section cut short
by its time box keeps what it measured.
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

    @property
    def cuda(self) -> bool:
        import torch

        return not self.dry and torch.cuda.is_available()

    def python(self, args: list[str], log: str, env: dict | None = None) -> subprocess.CompletedProcess:
        """This Python on `args` from the checkout's root, its output kept in logs/`log`."""
        done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, **(env or {})})
        (self.logs / log).write_text(done.stdout + done.stderr)
        return done


def environment(check: Check) -> dict:
    import torch
    import triton

    from lucebox.benchmark.record import commit

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda_runtime": torch.version.cuda,
            "python": sys.version.split()[0], "commit": commit(), "cuda_available": torch.cuda.is_available()}
    if not check.cuda:
        return {**info, "gpu": None, "note": "no CUDA device (dry run)" if check.dry else "no CUDA device"}
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {**info, "gpu": props.name, "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "driver": smi.stdout.strip() or smi.stderr.strip()}


def graph_tests(check: Check) -> dict:
    if not check.cuda:
        return {"status": "skipped", "reason": "needs CUDA: real graph capture and the bf16 kernels"}
    junit = check.logs / "graph_tests.xml"
    done = check.python(["-m", "pytest", "-q", "tests/test_kernels.py", "tests/test_cuda_graphs.py",
                         "-k", "test_kernels or on_cuda", "--junitxml", str(junit)], "graph_tests.log")
    from xml.etree import ElementTree

    suite = ElementTree.parse(junit).getroot().find("testsuite") if junit.exists() else None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    return {"status": "ok" if done.returncode == 0 else "failed", "returncode": done.returncode, **counts,
            "summary": done.stdout.strip().splitlines()[-1:] or done.stderr[-500:]}


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


def greedy_tokens(folder: str, tokens: int) -> list[int]:
    """The greedy tokens of a seeded prompt (int4, the default backend and graphs): what a race
    between streams would change."""
    import torch

    import lucebox

    cuda = torch.cuda.is_available()
    llm = lucebox.LLM(folder, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                      load_format="dummy", quantization="int4", max_context=1024)
    prompt = torch.randint(3, llm.config.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    return llm.generate(prompt, max_tokens=tokens, ignore_eos=True).token_ids


def stream_race(check: Check) -> dict:
    folder, tokens = str(race_model(check)), (64 if check.cuda else 4)
    runs = {}
    for blocking in ("0", "1"):
        start = time.perf_counter()
        done = check.python([__file__, "--greedy-tokens", folder, str(tokens)], f"stream_race_blocking{blocking}.log",
                            {"CUDA_LAUNCH_BLOCKING": blocking, **({"CUDA_VISIBLE_DEVICES": ""} if check.dry else {})})
        if done.returncode != 0:
            return {"status": "failed", "blocking": blocking, "error": done.stderr[-1500:]}
        runs[blocking] = {"tokens": json.loads(done.stdout.strip().splitlines()[-1]),
                          "seconds": time.perf_counter() - start}
    same = runs["0"]["tokens"] == runs["1"]["tokens"]
    pairs = zip(runs["0"]["tokens"], runs["1"]["tokens"], strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    return {"status": "ok" if same else "failed", "identical": same, "first_difference": first, "tokens": tokens,
            "run_seconds": {f"blocking={k}": v["seconds"] for k, v in runs.items()},
            **({} if check.cuda else {"note": "no CUDA: the two runs cannot race; checks the code path only"})}


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
    "environment": (environment, 15),
    "graph_tests": (graph_tests, 75),
    "laguna_xs2": (laguna_xs2, 200),
    "stream_race": (stream_race, 50),
    "drafter": (drafter, 50),
    "step_profile": (step_profile, 70),
}


def run_section(check: Check, name: str) -> bool:
    check.record(name, status="started", dry_run=check.dry)
    start = time.perf_counter()
    try:
        result = SECTIONS[name][0](check)
    except Exception as e:  # noqa: BLE001 - the record says what failed; later sections still run
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
    result = {"status": "ok", **result, "seconds": time.perf_counter() - start}
    check.record(name, **result)
    return result["status"] in ("ok", "skipped")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="directory of gpu-check.json and its logs")
    p.add_argument("--section", choices=list(SECTIONS), help="run this section only (default: all, in order)")
    p.add_argument("--dry-run", action="store_true", help="every section on the CPU at tiny shapes")
    p.add_argument("--list", action="store_true", help="print each section's name and time box, for the .sh")
    p.add_argument("--timed-out", metavar="SECTION", help="record that SECTION's process ran out of time")
    p.add_argument("--greedy-tokens", nargs=2, metavar=("FOLDER", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.list:
        print("\n".join(f"{name} {seconds}" for name, (_, seconds) in SECTIONS.items()))
        return
    if args.dry_run or not _has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    if args.greedy_tokens:
        print(json.dumps(greedy_tokens(args.greedy_tokens[0], int(args.greedy_tokens[1]))))
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
