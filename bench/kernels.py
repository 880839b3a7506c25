"""Kernel and whole-model decode bandwidth against the device's measured peak.

    python bench/kernels.py                 # GPU: Laguna XS.2 shapes, bf16 and int4, whole-model decode
    python bench/kernels.py --dry-run       # CPU, Triton interpreter, tiny shapes: checks the code runs

Every kernel reports achieved bandwidth: the bytes it must move (weights and caches read,
activations read and written) over its time, next to the peak measured here with a large
device-to-device copy (bytes read + written). On CUDA a kernel is timed inside a CUDA graph
of many calls, so Python launch overhead is not counted, and inputs rotate over copies bigger
than the L2 cache, so nothing is timed from cache.

The whole-model decode loads the real Laguna XS.2 config with random weights
(load_format="dummy") and reports tokens/s, the bytes one decode token must move (the weights it
reads: everything but the unchosen experts, plus its KV), and the roofline tokens/s that
bandwidth allows. Targets (from the kernels issue): MoE decode >= 60% of peak at M=1, a verify of
8 rows <= 1.5x one row, attention decode >= 70% of peak at 64K.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

XS2 = dict(hidden=2048, experts=256, top_k=8, expert_width=512, kv_heads=8, head_dim=128, full_heads=48,
           sliding_heads=64, window=512, contexts=[4096, 16384, 65536, 131072], copy_bytes=2 << 30,
           l2_bytes=256 << 20, routings=16, rows=(1, 4, 8, 16))
TINY = dict(hidden=64, experts=8, top_k=2, expert_width=32, kv_heads=2, head_dim=32, full_heads=4,
            sliding_heads=4, window=16, contexts=[256], copy_bytes=8 << 20, l2_bytes=1 << 20, routings=1,
            rows=(1, 8))  # the dry run checks the code at one row and at the targets' 8


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    p.add_argument("--config", default=str(ROOT / "examples" / "laguna-xs2"), help="model folder for the decode run")
    p.add_argument("--no-model", action="store_true", help="skip the whole-model decode")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--contexts", default="",
                   help="comma-separated contexts (e.g. 1024,32768,131072) for the long-context section: the "
                        "--config model with dummy int4 weights, CUDA graphs, KVFlash select, decode tokens/s "
                        "and peak memory at each")
    p.add_argument("--vram", default=None,
                   help="device memory budget for the long-context section (e.g. 24GiB): the engine plans within "
                        "it (lucebox.memory.vram) and holds the allocator to it; the plan goes in the JSON")
    p.add_argument("--kv-dtype", default="auto", help="auto | int8, for the long-context section")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                                              "bench/results replaces the committed result)")
    return p.parse_args()


class Timer:
    """Seconds per call of a list of calls that rotate inputs; CUDA graphs on the GPU."""

    def __init__(self, device, reps: int):
        self.device, self.reps = device, reps

    def __call__(self, calls) -> float:
        import torch

        if self.device.type != "cuda":  # the dry run: Triton's interpreter compiles nothing, so no warm-up
            start = time.perf_counter()
            for call in calls:
                call()
            return (time.perf_counter() - start) / len(calls)
        for call in calls:  # compile, tune, allocate
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        samples = []
        for _ in range(self.reps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1000 / len(calls))
        return statistics.median(samples)


def peak_bandwidth(device, nbytes: int, timer: Timer) -> float:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / timer([lambda: dst.copy_(src)])


def copies_for(one: int, shapes: dict) -> int:
    """How many input copies to rotate over so the set is bigger than the L2 cache."""
    return max(2, min(16, math.ceil(2 * shapes["l2_bytes"] / max(one, 1))))


def bench_moe(shapes, dtype, scheme, device, timer, peak) -> list[dict]:
    import torch
    from lucebox.kernels.moe_triton import moe_experts
    from lucebox.kernels.quant import quantize

    from lucebox.speculative.proposer import tensor_bytes

    H, E, F, K = shapes["hidden"], shapes["experts"], shapes["expert_width"], shapes["top_k"]
    gate_up = torch.empty(E, 2 * F, H, dtype=dtype, device=device).normal_(0, 0.02)
    down = torch.empty(E, H, F, dtype=dtype, device=device).normal_(0, 0.02)
    if scheme:
        gate_up, down = quantize(gate_up, scheme), quantize(down, scheme)
    per_expert = tensor_bytes([gate_up, down]) // E
    rows = []
    g = torch.Generator().manual_seed(0)
    for M in shapes["rows"]:
        for routing in ("independent", "shared"):
            if routing == "shared" and M == 1:
                continue
            calls, moved = [], []
            for _ in range(shapes["routings"]):  # experts change between calls, so none is timed from L2
                if routing == "shared":  # every row picks the same experts: the best case of a verify block
                    ids = torch.randperm(E, generator=g)[:K].repeat(M, 1)
                else:
                    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
                ids, weights = ids.to(device), torch.rand(M, K, generator=g).to(device)
                x = torch.randn(M, H, generator=g).to(dtype).to(device)
                act = x.element_size()
                moved.append(ids.unique().numel() * per_expert + 2 * M * H * act + M * K * (2 * F * act + 8 * H))
                calls.append(partial(moe_experts, x, gate_up, down, weights, ids))
            seconds = timer(calls)
            bandwidth = statistics.mean(moved) / seconds
            rows.append({"kernel": "moe_experts", "weights": scheme or str(dtype).split(".")[-1], "M": M,
                         "routing": routing, "us": seconds * 1e6, "bytes": int(statistics.mean(moved)),
                         "gb_per_s": bandwidth / 1e9, "fraction_of_peak": bandwidth / peak})
    return rows


def bench_attention(shapes, dtype, device, timer, peak) -> list[dict]:
    import torch
    from lucebox.kernels.attention_triton import attention_partial

    KV, D = shapes["kv_heads"], shapes["head_dim"]
    layers = [("full", shapes["full_heads"], S, None) for S in shapes["contexts"]]
    layers.append(("sliding", shapes["sliding_heads"], shapes["window"] + 16, shapes["window"]))
    rows = []
    for kind, Hq, S, window in layers:
        kv_bytes = 2 * KV * S * D * torch.finfo(dtype).bits // 8
        n = copies_for(kv_bytes, shapes)
        caches = [(torch.randn(KV, S, D, dtype=dtype, device=device), torch.randn(KV, S, D, dtype=dtype, device=device))
                  for _ in range(n)]
        k_positions = torch.arange(S, device=device)
        for M in shapes["rows"]:
            q = torch.randn(M, Hq, D, dtype=dtype, device=device)
            q_positions = torch.arange(S - M, S, device=device)  # the last M rows: causal inside the block
            calls = [partial(attention_partial, q, k, v, q_positions, k_positions, D**-0.5, window)
                     for k, v in caches]
            seconds = timer(calls)
            moved = kv_bytes + 2 * q.numel() * q.element_size()
            rows.append({"kernel": "attention", "layer": kind, "context": S, "M": M, "us": seconds * 1e6,
                         "bytes": moved, "gb_per_s": moved / seconds / 1e9, "fraction_of_peak": moved / seconds / peak})
        del caches
    return rows


def bench_linear(shapes, dtype, device, timer, peak) -> list[dict]:
    """A q projection (hidden -> heads x head_dim) in the model dtype (vendor GEMM) and quantized."""
    import torch
    from lucebox.kernels.backend import kernels_for
    from lucebox.kernels.quant import quantize

    from lucebox.speculative.proposer import tensor_bytes

    linear = kernels_for("triton").linear
    N, K = shapes["full_heads"] * shapes["head_dim"], shapes["hidden"]
    rows = []
    for scheme in (None, "int8", "int4"):
        plain = torch.empty(N, K, dtype=dtype, device=device).normal_(0, 0.02)
        w_bytes = tensor_bytes([quantize(plain, scheme) if scheme else plain])
        weights = [quantize(plain, scheme) if scheme else plain.clone() for _ in range(copies_for(w_bytes, shapes))]
        for M in shapes["rows"]:
            x = torch.randn(M, K, dtype=dtype, device=device)
            seconds = timer([partial(linear, x, w) for w in weights])
            moved = w_bytes + (M * K + M * N) * x.element_size()
            rows.append({"kernel": "linear", "weights": scheme or str(dtype).split(".")[-1], "N": N, "K": K, "M": M,
                         "us": seconds * 1e6, "bytes": moved, "gb_per_s": moved / seconds / 1e9,
                         "fraction_of_peak": moved / seconds / peak})
        del weights
    return rows


def bench_small(shapes, dtype, device, timer, peak) -> list[dict]:
    """RMSNorm + residual, RoPE, softplus gate: bytes in and out; launch-bound at decode sizes."""
    import torch
    from lucebox.kernels import gate_triton, norm_triton, rope_triton

    H, Hq, D = shapes["hidden"], shapes["full_heads"], shapes["head_dim"]
    inv_freq = torch.rand(D // 4, device=device)  # partial rotary, as on Laguna's full layers
    rows = []
    for M in shapes["rows"]:
        x, delta, w = (torch.randn(M, H, dtype=dtype, device=device) for _ in range(3))
        q = torch.randn(M, Hq, D, dtype=dtype, device=device)
        logits = torch.randn(M, Hq, dtype=dtype, device=device)
        positions = torch.arange(M, device=device) + 1000
        size = x.element_size()
        for name, call, moved in (
            ("add_rms_norm", partial(norm_triton.add_rms_norm, x, delta, w[0], 1e-6), 5 * M * H * size),
            ("rope", partial(rope_triton.rotate, (q,), positions, inv_freq, 1.0), 2 * q.numel() * size),
            ("softplus_gate", partial(gate_triton.softplus_gate, q, logits), 2 * q.numel() * size),
        ):
            seconds = timer([call])
            rows.append({"kernel": name, "M": M, "us": seconds * 1e6, "bytes": moved,
                         "gb_per_s": moved / seconds / 1e9, "fraction_of_peak": moved / seconds / peak})
    return rows


def decode_bytes_per_token(llm, context: int) -> int:
    """Bytes one decode token must read: every weight but the unchosen experts, one embedding
    row instead of the table, and the KV of the context."""
    from lucebox.memory.expert_cache import is_routed_expert
    from lucebox.speculative.proposer import tensor_bytes

    cfg, w = llm.config, llm.engine.decoder.w
    total = tensor_bytes(w.values()) - tensor_bytes([w["embed"]]) + w["embed"][0].numel() * w["embed"].element_size()
    if cfg.moe is not None:
        for name, t in w.items():
            if is_routed_expert(name):
                total -= tensor_bytes([t]) * (cfg.moe.num_experts - cfg.moe.top_k) // cfg.moe.num_experts
    row = cfg.kv_bytes_per_token(llm.dtype.itemsize)  # one layer's K and V of one token
    total += sum(min(context, layer.window or context) * row for layer in cfg.layers)
    return total


def bench_model(folder, dtype, device, peak, tokens: int, dry: bool) -> list[dict]:
    import torch

    import lucebox

    rows = []
    prompt = list(range(3, 3 + (32 if dry else 512)))
    runs = [("triton", None, True), ("triton", "int4", True), ("triton", None, False), ("torch", None, False)]
    if dry:
        runs = [("triton", None, False), ("triton", "int4", False)]
    for backend, scheme, graphs in runs:
        llm = lucebox.LLM(folder, device=device.type, dtype=str(dtype).split(".")[-1], load_format="dummy",
                          backend=backend, quantization=scheme, max_context=4096,
                          cuda_graphs=graphs if device.type == "cuda" else None)
        llm.generate(prompt, max_tokens=4, ignore_eos=True)  # warm up: compile, capture
        stats = llm.generate(prompt, max_tokens=tokens, ignore_eos=True).stats
        per_token = decode_bytes_per_token(llm, len(prompt) + tokens // 2)
        verify = {}
        if not dry:
            from lucebox.speculative.drafters import measure_verify_seconds

            verify = measure_verify_seconds(llm.engine.runner, llm.engine.new_cache(), llm.engine.clock, widths=(1, 8))
        rate = stats["decode_tokens_per_s"]
        rows.append({"backend": backend, "weights": scheme or str(dtype).split(".")[-1], "cuda_graphs": graphs,
                     "decode_tokens_per_s": rate, "bytes_per_token": per_token,
                     "achieved_gb_per_s": rate * per_token / 1e9, "roofline_tokens_per_s": peak / per_token,
                     "fraction_of_roofline": rate * per_token / peak,
                     "verify8_over_decode1": verify[8] / verify[1] if verify else None})
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def contexts_llm(folder, dtype, device, max_context: int, vram: str | None = None, kv_dtype: str = "auto"):
    """The model `bench_contexts` measures: dummy int4 weights, graphs on where there is CUDA."""
    import lucebox

    return lucebox.LLM(folder, device=device.type, dtype=str(dtype).split(".")[-1], load_format="dummy",
                       quantization="int4", max_context=max_context, vram_budget=vram, kv_dtype=kv_dtype)


def bench_contexts(folder, dtype, device, contexts: list[int], tokens: int, vram: str | None = None,
                   kv_dtype: str = "auto", llm=None) -> list[dict]:
    """Decode speed and peak device memory of the model (`contexts_llm`, or `llm` if given) after
    prompts of each length, within the `vram` budget if given. Prompts nest (one seeded stream of
    tokens), so each one reuses the cache of the one before and prefills only its new tokens."""
    import torch

    llm = llm or contexts_llm(folder, dtype, device, max(contexts) + tokens + 1, vram, kv_dtype)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, llm.config.vocab_size, (max(contexts),), generator=gen).tolist()
    rows = []
    for context in sorted(contexts):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        llm.prefill(prompt[:context])
        stats = llm.generate(prompt[:context], max_tokens=tokens, ignore_eos=True).stats
        rows.append({"context": context, "weights": "int4", "kv_policy": llm.setup.cache.kv_policy,
                     "kv_pool_tokens": llm.setup.cache.kv_pool_tokens, "cuda_graphs": llm.engine.runner.graphs,
                     "decode_tokens_per_s": stats["decode_tokens_per_s"], "generated_tokens": stats["generated_tokens"],
                     "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                     "memory": llm.memory(), "vram_budget": vram, "kv_dtype": kv_dtype,
                     "vram_plan": llm.vram_plan.as_json() if llm.vram_plan is not None else None,
                     "expert_hit_rate": stats.get("expert_hit_rate")})
        print(f"context {context}: {rows[-1]['decode_tokens_per_s']:.1f} tokens/s", flush=True)
    return rows


def dry_run_model() -> Path:
    """examples/laguna-tiny cut to two layers (one full, one sliding) and small widths: the
    interpreter runs every kernel instance in Python."""
    config = json.loads((ROOT / "examples" / "laguna-tiny" / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "sparse"], num_attention_heads_per_layer=[4, 4], num_attention_heads=4,
                  hidden_size=128, intermediate_size=256, vocab_size=512, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=32, num_key_value_heads=2)
    folder = Path(tempfile.mkdtemp()) / "laguna-dry-run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def main() -> None:
    args = parse_args()
    dry = args.dry_run
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    from bench.common import write_result

    if not dry and not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU kernels; on a machine without CUDA run it with --dry-run")
    device = torch.device("cpu" if dry else "cuda")
    shapes = TINY if dry else XS2
    # The interpreter computes bfloat16 wrongly, so the dry run uses float32.
    dtype = torch.float32 if dry else torch.bfloat16
    timer = Timer(device, reps=1 if dry else 20)
    peak = peak_bandwidth(device, shapes["copy_bytes"], timer)
    results = {"peak_gb_per_s": peak / 1e9, "dry_run": dry, "shapes": {k: v for k, v in shapes.items()}}
    out = Path(args.out) if args.out else None
    sections = [
        ("moe", lambda: bench_moe(shapes, dtype, None, device, timer, peak)
         + bench_moe(shapes, dtype, "int4", device, timer, peak)),
        ("attention", lambda: bench_attention(shapes, dtype, device, timer, peak)),
        ("linear", lambda: bench_linear(shapes, dtype, device, timer, peak)),
        ("small", lambda: bench_small(shapes, dtype, device, timer, peak)),
    ]
    if not args.no_model:
        folder = dry_run_model() if dry else Path(args.config)
        sections.append(("model", lambda: bench_model(folder, dtype, device, peak, 3 if dry else args.decode_tokens,
                                                      dry)))
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
        folder = dry_run_model() if dry else Path(args.config)
        sections.append(("contexts", lambda: bench_contexts(folder, dtype, device, contexts,
                                                            3 if dry else args.decode_tokens, args.vram,
                                                            args.kv_dtype)))
    for name, run in sections:
        results[name] = run()
        path = write_result("kernels", results, out)  # after every section: a timeout keeps what was measured
        print(f"{name}: done, {path}", flush=True)
    results["targets"] = targets(results, shapes)
    write_result("kernels", results, out)
    for name, value in results["targets"].items():
        print(f"{name}: {value}")


def targets(results: dict, shapes: dict) -> dict:
    def pick(rows, **match):
        return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)

    moe1 = pick(results["moe"], weights="bfloat16", M=1) or pick(results["moe"], M=1)
    longest = 65536 if 65536 in shapes["contexts"] else max(shapes["contexts"])
    att1 = pick(results["attention"], layer="full", context=longest, M=1)
    att8 = pick(results["attention"], layer="full", context=longest, M=8)
    shared8 = pick(results["moe"], weights=moe1["weights"], M=8, routing="shared")
    independent8 = pick(results["moe"], weights=moe1["weights"], M=8, routing="independent")
    out = {
        "moe_decode_fraction_of_peak_M1 (target >= 0.60)": moe1["fraction_of_peak"],
        f"attention_decode_fraction_of_peak_{longest} (target >= 0.70)": att1["fraction_of_peak"],
        f"attention_verify8_over_decode1_{longest} (target <= 1.5)": att8["us"] / att1["us"],
        "moe_verify8_over_decode1_shared_experts (target <= 1.5)": shared8["us"] / moe1["us"],
        "moe_verify8_over_decode1_independent_experts": independent8["us"] / moe1["us"],
    }
    for row in results.get("model", []):
        if row.get("verify8_over_decode1"):
            out[f"model_verify8_over_decode1_{row['backend']}_{row['weights']} (target <= 1.5)"] = \
                row["verify8_over_decode1"]
    return out


if __name__ == "__main__":
    main()
