"""Host work per decoded token and per speculative round, measured on the CPU: what would keep a
GPU waiting.

The model is Laguna XS.2's layer pattern (40 layers, 1 full : 3 sliding, 256 experts top-8,
window 512) at a tiny width with random weights, on the graphed path (Triton kernels, each
decode/verify step one graph, `lucebox.engine.runner`). Device work is made free so only host work
remains:
- every Triton launch is stubbed (counted, not run);
- a graph's replay returns the outputs its first run left (counted, not run);
- fresh tensors are zero-filled, so stubbed kernels leave finite numbers behind.

Counted per decoded token (plain greedy decoding) and per speculative round (the n-gram drafter,
whose drafts here are always accepted): graph replays, Triton launches, ATen kernels run eagerly
outside graphs (by where they run: the step's input upload, the decision, the caches' commit and
rollback, which hold KVFlash re-selection every `kv_reselect_every` tokens), host reads of
device values (`item`, `tolist`, `int()`, ... on a tensor: each one a sync on a GPU),
synchronizing clock reads, and host CPU time (a separate, uncounted pass: the counters slow the
host down).

    python bench/host_overhead.py                       # writes bench/results/local/
    python bench/host_overhead.py --out bench/results   # replaces the committed result

It also measures the commits before the one-graph step (piecewise graph segments, the decode
loop in `lucebox.llm`), which is how `bench/results/host_overhead_before-cpu.json` was made: a
`git worktree` of a036709 with `lucebox/kernels` and `lucebox/models` linked to `../kernels`
and `../models` (the installed package maps them) and this file copied into its `bench/`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the Triton backend on the CPU; its launches are stubbed below

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import write_result  # noqa: E402

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
NEW_TENSORS = ("empty", "empty_like", "empty_strided")


def tiny_laguna_xs2(folder: Path) -> Path:
    """Laguna XS.2's config.json with every width shrunk, its layer pattern and expert count kept."""
    cfg = json.loads((ROOT / "examples" / "laguna-xs2" / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_attention_heads_per_layer=[4] * layers, num_key_value_heads=2, head_dim=16,
               moe_intermediate_size=16, shared_expert_intermediate_size=16, max_position_embeddings=16384,
               torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


class Counters:
    """The instruments, switched on only while `counting` is true."""

    def __init__(self):
        self.counting = False
        self.silent = False  # inside a graph or a stand-in: ops are not host work we measure
        self.phase = "other"  # where eager kernels run (see `instruments`)
        self.c: Counter[str] = Counter()
        self.round_ends: list[tuple[float, float]] = []  # (host CPU time, eager kernels so far) at each decision

    def add(self, what: str, n: int = 1) -> None:
        if self.counting:
            self.c[what] += n


class EagerOps(TorchDispatchMode):
    """Counts ATen ops dispatched outside graph segments: kernels (each a launch on a GPU) and
    views (host work only)."""

    def __init__(self, counters: Counters):
        super().__init__()
        self.counters = counters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.counters.silent:
            if func.is_view:
                self.counters.add("eager_views")
            else:
                self.counters.add("eager_kernels")
                self.counters.add(f"eager_kernels.{self.counters.phase}")
        return func(*args, **(kwargs or {}))


@contextmanager
def patched(owner, name: str, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def loop_modules() -> list:
    """The modules whose decode loop calls `decide` once per round (the speculation stage: its first
    token, then, since a round returns its verdict, each chain round's in a module of its own;
    before the stage existed, `lucebox.llm`), so that rounds can be timed and counted on older
    commits too."""
    try:
        from lucebox.speculative import rounds
    except ImportError:
        import lucebox.llm
        return [lucebox.llm]
    try:
        from lucebox.speculative import chain_round
    except ImportError:
        return [rounds]
    return [rounds, chain_round]


def graphed_path(llm):
    """Put the engine on its graphed path, run without capture; returns the class whose `run`
    replays a graph (this commit's one graph per step, or the piecewise segments before it)."""
    try:
        from lucebox.engine.runner import StepGraph, StepRunner
    except ImportError:
        from lucebox.models.graphs import DecodeGraphs, _Segment
        llm.engine.decoder.graphs = DecodeGraphs(llm.engine.decoder, capture=False)
        return _Segment
    engine = getattr(llm, "engine", llm)  # the engine's parts moved out of `LLM` itself
    engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    return StepGraph


def instruments(counters: Counters, llm, graph_class) -> ExitStack:
    """Stub the device work, count the host's."""
    from lucebox.caches import SequenceCache

    stack = ExitStack()

    def launch(original):
        def run(self, *args, **kwargs):
            counters.add("triton_launches")
        return run

    launcher = type(triton.jit(lambda: None))  # JITFunction, or the interpreter's stand-in for it
    stack.enter_context(patched(launcher, "run", launch))

    def graph(original):
        def run(self):
            if self.out:  # a replay: on a GPU the captured work runs on the device, not here
                counters.add("graph_replays")
                return self.out
            counters.silent = True
            try:
                return original(self)
            finally:
                counters.silent = False
        return run

    stack.enter_context(patched(graph_class, "run", graph))

    def phase(name):
        def wrap(original):
            def f(*args, **kwargs):
                outer, counters.phase = counters.phase, name
                try:
                    return original(*args, **kwargs)
                finally:
                    counters.phase = outer
            return f
        return wrap

    def each_round(original):  # a round ends with its decision
        def f(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                counters.round_ends.append((time.process_time(), counters.c["eager_kernels"]))
        return f

    for loop in loop_modules():
        stack.enter_context(patched(loop, "decide", each_round))
        stack.enter_context(patched(loop, "decide", phase("decide")))
    stack.enter_context(patched(SequenceCache, "commit", phase("commit_and_reselect")))
    stack.enter_context(patched(SequenceCache, "rollback", phase("rollback")))
    runner = sys.modules.get("lucebox.engine.runner")
    if runner is not None:
        stack.enter_context(patched(runner.StepRunner, "step", phase("step")))

    for name in READS:
        def read(original, name=name):
            def f(self, *args, **kwargs):
                counters.add("host_reads")
                counters.add(f"host_reads.{name}")
                return original(self, *args, **kwargs)
            return f
        stack.enter_context(patched(torch.Tensor, name, read))

    for name in NEW_TENSORS:
        def zeroed(original):
            def f(*args, **kwargs):
                tensor = original(*args, **kwargs)
                quiet, counters.silent = counters.silent, True  # the stand-in's own work: not counted
                try:
                    return tensor.zero_()
                finally:
                    counters.silent = quiet
            return f
        stack.enter_context(patched(torch, name, zeroed))

    def clock(original):
        def f(self, *args, **kwargs):
            if not args or args[0]:  # `clock()` / `clock(True)` synchronizes on a GPU
                counters.add("synchronizing_clock_reads")
            return original(self, *args, **kwargs)
        return f

    try:
        from lucebox.device import DeviceClock
        stack.enter_context(patched(DeviceClock, "__call__", clock))
    except ImportError:  # before the clock was its own object: a method of `LLM`
        stack.enter_context(patched(type(llm), "_clock", clock))
    return stack


def measure(llm, prompt: list[int], tokens: int, counters: Counters) -> dict:
    """Counts and host CPU time per decode round, in a request decoding `tokens` tokens after
    `prompt` (cached). Counts: that request's minus one's that stops at its first token (the
    prompt's last row and the request's start), over the rounds between them. Host CPU time: the
    median time from one round's decision to the next's (the text stage, the loop and the round),
    in a separate, uncounted request (the counters cost time)."""
    def run(max_tokens: int) -> dict:
        return llm.generate(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0).stats

    # Every width's graph runs once (its "capture") before anything is counted (below: the first
    # of the requests that put the cache in the same state before each measured one).
    counted, rounds = [], []
    for max_tokens in (1, tokens + 1):
        run(tokens + 1)  # both requests start from the cache this request leaves
        counters.c.clear()
        counters.round_ends.clear()
        counters.counting = True
        with torch.inference_mode(), EagerOps(counters):
            stats = run(max_tokens)
        counters.counting = False
        counted.append(Counter(counters.c))
        rounds.append(stats["rounds"] if max_tokens > 1 else 0)
    n = rounds[1] - rounds[0]
    counts = {k: (counted[1][k] - counted[0][k]) / n for k in sorted(counted[1] | counted[0])}
    kernels = [b[1] - a[1] for a, b in itertools.pairwise(counters.round_ends)]
    typical = Counter(kernels).most_common(1)[0]
    counters.round_ends.clear()
    run(tokens + 1)
    seconds = [b[0] - a[0] for a, b in itertools.pairwise(counters.round_ends)]
    return {
        "rounds": n,
        "tokens_per_round": tokens / n,
        "per_round": counts,
        # Most rounds run no KVFlash work (re-selection, a new chunk's residency): what they launch.
        "eager_kernels_in_most_rounds": {"kernels": typical[0], "rounds": typical[1], "of": len(kernels)},
        "host_cpu_ms_per_round": 1e3 * statistics.median(seconds),
        "host_cpu_ms_per_round_mean": 1e3 * statistics.fmean(seconds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding")
    p.add_argument("--tokens", type=int, default=64,
                   help="tokens decoded per measurement (64: one KVFlash re-selection among them)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()

    import lucebox

    torch.set_num_threads(1)
    counters = Counters()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny_laguna_xs2(Path(tmp))
        common = dict(load_format="dummy", device="cpu", dtype="float32", backend="triton", max_context=8192,
                      kv_policy="select", kv_pool_tokens=1024, prefill_chunk=512)
        engines = {"plain decoding, per token": lucebox.LLM(folder, **common),
                   "speculative (n-gram), per round": lucebox.LLM(folder, draft="ngram", adaptive=False, draft_k=7,
                                                                   **common)}
        # Stubbed kernels leave zeros: the model predicts token 0 forever, so a prompt of zeros
        # gives the n-gram drafter full-width rounds that are always accepted.
        prompt = [0] * args.context
        for name, llm in engines.items():
            with instruments(counters, llm, graphed_path(llm)):
                llm.generate(prompt, max_tokens=2, ignore_eos=True)  # the prompt's rows, cached once
                rows[name] = measure(llm, prompt, args.tokens, counters)
    payload = {"model": "Laguna XS.2 layer pattern at tiny width (examples/laguna-xs2, hidden 64), random weights",
               "setup": {"context": args.context, "tokens": args.tokens, "kv_policy": "select",
                         "kv_pool_tokens": 1024, "host_offload": True, "backend": "triton (launches stubbed)",
                         "graphs": "one per step and width, replays free"},
               "results": rows}
    for name, row in rows.items():
        counts = ", ".join(f"{k} {v:.1f}" for k, v in row["per_round"].items() if "." not in k)
        most = row["eager_kernels_in_most_rounds"]
        print(f"{name}: {counts}; host CPU {row['host_cpu_ms_per_round']:.2f} ms (median) "
              f"({row['tokens_per_round']:.2f} tokens per round); {most['kernels']} eager kernels in "
              f"{most['rounds']} of {most['of']} rounds")
    print(f"wrote {write_result('host_overhead', payload, args.out)}")


if __name__ == "__main__":
    main()
