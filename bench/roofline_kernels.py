"""The roofline per kernel: each Triton kernel call of a Laguna XS.2 int4 decode step, predicted on an
RTX 3090, an RTX 4090, an H100 and an H200, so a GPU run is compared kernel by kernel.

    python3 bench/roofline_kernels.py --out bench/results/roofline-kernels.json   # regenerate the table

(one command; compiles each call's specialization for sm_86 with `bench/kernel_specs.py`'s `spec_one`,
a few minutes on 2 cores; re-run it after the kernels change). `bench/gpu_check.py`'s kernel_table
section times the same calls (`decode_calls`) on the GPU and puts each measured time beside its row.

Per call (rows 1, 4 and 16): the launch is recorded as Triton's launcher would make it (grid,
constexprs), compiled for sm_86 (registers, warps, shared memory, hot-loop SASS instructions per
streamed byte). Then, per hardware:

    programs = grid size; blocks per SM = min(warp slots / warps, 65536 / (registers x 32 x warps),
               shared memory per SM / shared bytes); waves = ceil(programs / (SMs x blocks per SM))
    active SMs = min(SMs, programs)   (a grid smaller than the card leaves SMs idle)
    bandwidth_s = bytes / (bandwidth x active SMs / SMs)
    issue_s = streamed bytes x instructions per byte / (active SMs x min(4, warps per SM) x clock)
    seconds = max(bandwidth_s, issue_s) + launch gap   (one dependent graph node)

Bytes are what the call must move: its weights (int4 codes and scales; a MoE call the distinct
experts its rows chose, expected over uniform routing, plus the shared expert: today's kernels read
an expert once per (row, expert) pair, so at 16 rows they move up to 129/101 of that unless the L2
cache holds what another row read), the router in float32 (its
stored dtype, kernels/moe.py `routing_dtype`), the KV it reads (a sliding layer its window; a full
layer at 32K/128K the `select` pool, whose every live row the attention kernel loads before masking:
`CacheSettings.for_engine` decides the pool, not a constant here), and activations. sm_86 SASS
counts stand in for every card (sm_89/sm_90 code may differ). Nothing here was measured on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from roofline import HARDWARE, LAUNCH_SECONDS, full_layer_kv_tokens  # noqa: E402

ROWS = (1, 4, 16)
CONTEXTS = (1024, 32768, 131072)
REGISTERS_PER_SM = 65536


@dataclass
class Call:
    """One kernel call of a decode step: `run()` launches it; `per_token` calls a token (layers)."""

    name: str
    rows: int
    context: int | None
    per_token: int
    bytes: int
    run: object  # a callable
    split: dict | None = None  # kernel name part -> its share of the bytes (default: even)


def xs2_widths() -> dict:
    from lucebox.models import build_model_config

    cfg = build_model_config(json.loads((ROOT / "examples" / "laguna-xs2" / "config.json").read_text()))
    full = [layer for layer in cfg.layers if not layer.window]
    sliding = [layer for layer in cfg.layers if layer.window]
    return {"cfg": cfg, "full": len(full), "sliding": len(sliding), "window": sliding[0].window,
            "moe_layers": sum(layer.mlp == "moe" for layer in cfg.layers),
            "dense_layers": sum(layer.mlp == "dense" for layer in cfg.layers)}


def expected_experts(rows: int, top_k: int, experts: int) -> float:
    """Distinct experts `rows` rows choose under uniform routing (top_k each)."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def decode_calls(device, dtype, rows: int, contexts, experts: int | None = None) -> list[Call]:
    """The Triton calls of one XS.2 int4 decode step at `rows` rows: the weights' once, attention's
    at each of `contexts`. `experts` smaller than the model's keeps recording cheap (grids and
    constexprs do not depend on it); the bytes are always the model's."""
    calls = weight_calls(device, dtype, rows, experts)
    for context in contexts:
        calls += attention_calls(rows, context, device, dtype)
    return calls


def attention_heads(cfg) -> dict:
    return {kind: cfg.layers[_first(cfg, kind == "sliding")].num_heads for kind in ("full", "sliding")}


def weight_calls(device, dtype, rows: int, experts: int | None = None) -> list[Call]:
    """The calls reading weights: the projections (int4 GEMV), the MoE experts and the router."""
    import torch
    from lucebox.kernels import moe_triton, quant_triton, route_triton
    from lucebox.kernels.quant import quantize

    w = xs2_widths()
    cfg, moe = w["cfg"], w["cfg"].moe
    H, D, KV, F = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, moe.expert_size
    E = experts or moe.num_experts
    act = torch.tensor([], dtype=dtype).element_size()

    def randn(*shape, kind=dtype):
        return torch.randn(*shape, dtype=kind, device=device)

    calls = []

    def linear(name: str, n: int, k: int, per_token: int) -> None:
        q = quantize(randn(n, k), "int4")
        x = randn(rows, k)
        nbytes = q.codes.nbytes + q.scales.nbytes + rows * (n + k) * act
        calls.append(Call(name, rows, None, per_token, nbytes, lambda: quant_triton.quantized_linear(x, q)))

    heads = attention_heads(cfg)
    for kind in ("full", "sliding"):
        gate = {None: 0, "head": heads[kind]}.get(cfg.attention_gate, heads[kind] * D)  # the softplus gate's rows
        linear(f"qkv_{kind}", (heads[kind] + 2 * KV) * D + gate, H, w[kind])
        linear(f"o_{kind}", H, heads[kind] * D, w[kind])
    if w["dense_layers"]:
        linear("dense_gate_up", 2 * cfg.intermediate_size, H, w["dense_layers"])
        linear("dense_down", H, cfg.intermediate_size, w["dense_layers"])
    gate_up, down = quantize(randn(E, 2 * F, H), "int4"), quantize(randn(E, H, F), "int4")
    Fs = moe.shared_expert_size
    shared = [quantize(randn(2 * Fs, H), "int4"), quantize(randn(H, Fs), "int4")]
    per_expert = sum(t.nbytes for t in (gate_up.codes[0], gate_up.scales[0], down.codes[0], down.scales[0]))
    shared_bytes = sum(t.codes.nbytes + t.scales.nbytes for t in shared)
    x = randn(rows, H)
    ids = torch.stack([torch.randperm(E, device=device)[: moe.top_k] for _ in range(rows)])
    weights = torch.rand(rows, moe.top_k, device=device)
    chosen = expected_experts(rows, moe.top_k, moe.num_experts)
    moe_bytes = int(chosen * per_expert + shared_bytes + 2 * rows * H * act)
    calls.append(Call("moe_experts", rows, None, w["moe_layers"], moe_bytes,
                      lambda: moe_triton.moe_experts(x, gate_up, down, weights, ids, moe.routed_scaling, *shared),
                      split={"up": 2 / 3, "down": 1 / 3}))  # gate and up (2F x H) against down (H x F)
    router, bias = randn(moe.num_experts, H, kind=torch.float32), randn(moe.num_experts, kind=torch.float32)
    calls.append(Call("route", rows, None, w["moe_layers"], router.nbytes + rows * H * act,
                      lambda: route_triton.moe_route(x, router, moe, bias),
                      split={"logits": 1.0}))  # the top-k choice after it reads only the logits
    return calls


def attention_calls(rows: int, context: int, device, dtype) -> list[Call]:
    """A sliding layer's attention over its window, a full layer's over what its pool holds."""
    import torch
    from lucebox.kernels import attention_triton

    w = xs2_widths()
    cfg, D, KV = w["cfg"], w["cfg"].head_dim, w["cfg"].num_kv_heads
    heads = attention_heads(cfg)
    calls = []
    for kind, tokens in (("sliding", min(context, w["window"])), ("full", full_layer_kv_tokens(context))):
        k = torch.randn(KV, tokens, D, dtype=dtype, device=device)
        v, q = torch.randn_like(k), torch.randn(rows, heads[kind], D, dtype=dtype, device=device)
        positions = torch.arange(tokens, device=device)
        window = w["window"] if kind == "sliding" else None
        select = kind == "full" and tokens < context  # the select pool: sink + chosen chunks pinned, a tail
        pinned = (positions < 64) if select else None

        def run(q=q, k=k, v=v, positions=positions, window=window, pinned=pinned):
            return attention_triton.attention_partial(q, k, v, positions[-rows:], positions, D**-0.5, window,
                                                      pinned, 256 if pinned is not None else 0)

        nbytes = k.nbytes + v.nbytes + 2 * q.nbytes
        calls.append(Call(f"attention_{kind}", rows, context, w[kind], nbytes, run))
    return calls


def _first(cfg, sliding: bool) -> int:
    return next(i for i, layer in enumerate(cfg.layers) if bool(layer.window) == sliding)


def record_calls(calls: list[Call]) -> list[dict]:
    """Each call's launches as Triton's launcher would make them on a GPU (bench/triton_compile.py),
    with their grids: [{"call": Call, "launches": [(Launch, grid)]}]."""
    from triton.runtime.jit import JITFunction

    from bench.triton_compile import record_launches

    recorded = []
    for call in calls:
        grids = []

        def exercise(call=call, grids=grids):
            theirs = JITFunction.run  # record_launches' recorder, wrapped to keep each launch's grid

            def run(self, *args, grid, warmup, **kwargs):
                meta = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
                grids.append(tuple(grid(meta) if callable(grid) else grid))
                return theirs(self, *args, grid=grid, warmup=warmup, **kwargs)

            JITFunction.run = run
            try:
                call.run()
            finally:
                JITFunction.run = theirs

        launches = record_launches(exercise)
        recorded.append({"call": call, "launches": list(zip(launches, grids[: len(launches)], strict=True))})
    return recorded


def occupancy(spec: dict, hw) -> int:
    """Blocks of this kernel one SM holds at once: warp slots, registers and shared memory."""
    warps = spec["num_warps"]
    by_warps = hw.warps_per_sm // warps
    by_registers = REGISTERS_PER_SM // max(1, spec["registers"] * 32 * warps)
    by_shared = hw.shared_per_sm // spec["shared_bytes"] if spec["shared_bytes"] else by_warps
    return max(1, min(by_warps, by_registers, by_shared))


def predict_launch(spec: dict, grid: tuple, nbytes: float, hw, launch_seconds: float) -> dict:
    """One launch's predicted time on `hw` (the module doc's formulas)."""
    programs = math.prod(grid)
    per_sm = occupancy(spec, hw)
    active = min(hw.sms, programs)
    bandwidth_s = nbytes / (hw.bandwidth * active / hw.sms)
    per_byte = spec.get("instructions_per_byte")
    streamed = nbytes if per_byte is not None else 0.0
    warps_per_sm = min(per_sm, math.ceil(programs / active)) * spec["num_warps"]
    issue_rate = active * min(hw.schedulers_per_sm, warps_per_sm) * hw.clock_hz
    issue_s = streamed * (per_byte or 0.0) / issue_rate
    return {"programs": programs, "blocks_per_sm": per_sm, "waves": math.ceil(programs / (hw.sms * per_sm)),
            "programs_per_sm": programs / hw.sms, "active_sms": active, "instructions": streamed * (per_byte or 0.0),
            "bandwidth_s": bandwidth_s, "issue_s": issue_s, "launch_s": launch_seconds,
            "seconds": max(bandwidth_s, issue_s) + launch_seconds,
            "bound": "instructions" if issue_s > bandwidth_s else "bandwidth"}


def kernel_rows(recorded: list[dict], specs: dict, hardware: dict, launch_seconds: float) -> list[dict]:
    """One row per (call, launch): its compile statistics and a prediction per hardware. A call of
    several launches (MoE up, then down) splits its bytes by each launch's streamed share when the
    specs say it, else evenly."""
    rows = []
    for entry in recorded:
        call, launches = entry["call"], entry["launches"]
        every = [launch for launch, _ in launches]
        streaming = [launch for launch in every if "role" in specs[_key(launch)]] or every
        for launch, grid in launches:
            spec = specs[_key(launch)]
            share = call.bytes * _share(call, launch, streaming)
            row = {"call": call.name, "rows": call.rows, "context": call.context, "per_token": call.per_token,
                   "kernel": launch.kernel, "grid": list(grid), "bytes": share,
                   **{k: spec.get(k) for k in ("registers", "num_warps", "shared_bytes", "n_spills",
                                               "hot_loop_instructions", "instructions_per_byte")}}
            if "error" in spec:
                row["error"] = spec["error"]
            else:
                row["predicted"] = {name: predict_launch(spec, grid, share, hw, launch_seconds)
                                    for name, hw in hardware.items()}
            rows.append(row)
    return rows


def _share(call: Call, launch, streaming: list) -> float:
    """The fraction of a call's bytes a launch moves: `call.split`'s share for the part its kernel
    name holds (none when it names no part), else the streaming launches (a kernel_specs rule) split
    them evenly and the others (merges) move none."""
    if call.split:
        return next((fraction for part, fraction in call.split.items() if part in launch.kernel), 0.0)
    return 1 / len(streaming) if launch in streaming else 0.0


def _key(launch) -> str:
    return json.dumps([launch.kernel, launch.named_constexprs(), launch.signature], sort_keys=True, default=str)


def compile_specs(recorded: list[dict]) -> dict:
    """kernel_specs.spec_one (sm_86) of every distinct launch, compiled in parallel."""
    from kernel_specs import crashed, spec_one

    from bench.triton_compile import compile_all

    distinct = {}
    for entry in recorded:
        for launch, _ in entry["launches"]:
            distinct.setdefault(_key(launch), launch)
    results = compile_all(list(distinct.values()), spec_one, crashed)
    return dict(zip(distinct, results, strict=True))


def token_totals(rows: list[dict], hardware: dict) -> list[dict]:
    """Per hardware, rows and context: the Triton kernels' predicted time a token (calls x per_token)."""
    totals = {}
    for row in rows:
        for name, p in row.get("predicted", {}).items():
            for context in ([row["context"]] if row["context"] else CONTEXTS):
                key = (name, row["rows"], context)
                totals[key] = totals.get(key, 0.0) + p["seconds"] * row["per_token"]
    return [{"hardware": h, "rows": r, "context": c, "triton_kernels_s_per_step": s} for (h, r, c), s in
            sorted(totals.items())]


def table(rows: list[dict], hw_name: str) -> str:
    lines = [f"{'call':<16} {'rows':>4} {'ctx':>6} {'kernel':<22} {'grid':<14} {'regs':>4} {'w':>2} {'MB':>7} "
             f"{'instr/B':>7} {'waves':>5} {'us':>8} bound ({hw_name})"]
    for r in rows:
        p = r.get("predicted", {}).get(hw_name)
        if p is None:
            lines.append(f"{r['call']:<16} {r['rows']:>4} ERROR {r.get('error', '')[:80]}")
            continue
        per_byte = f"{r['instructions_per_byte']:.3f}" if r["instructions_per_byte"] is not None else "-"
        lines.append(f"{r['call']:<16} {r['rows']:>4} {r['context'] or '':>6} {r['kernel']:<22} "
                     f"{'x'.join(map(str, r['grid'])):<14} {r['registers']:>4} {r['num_warps']:>2} "
                     f"{r['bytes'] / 1e6:>7.2f} {per_byte:>7} {p['waves']:>5} {p['seconds'] * 1e6:>8.1f} {p['bound']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    import bench.triton_compile  # noqa: F401 - turns Triton's interpreter off before a kernel module loads
    from lucebox.benchmark.record import commit, machine, utc_now

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the JSON here (default: print the table only)")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--calls", nargs="+", default=None, help="only these calls (e.g. qkv_full moe_experts; tests)")
    args = p.parse_args(argv)
    calls = [c for rows in args.rows for c in decode_calls(torch.device("cpu"), torch.bfloat16, rows, args.contexts,
                                                           experts=8) if not args.calls or c.name in args.calls]
    recorded = record_calls(calls)
    specs = compile_specs(recorded)
    rows = kernel_rows(recorded, specs, HARDWARE, LAUNCH_SECONDS)
    record = {"benchmark": "roofline_kernels", "date": utc_now(), "commit": commit(), "machine": machine(),
              "command": " ".join(["python3", "bench/roofline_kernels.py", *(sys.argv[1:] if argv is None else argv)]),
              "gpu_measurements": "none: every figure here is a model, nothing was run on a GPU",
              "model": "examples/laguna-xs2 (int4 weights, bf16 activations, fused qkv projections)",
              "assumed": {"hardware": {k: vars(v) for k, v in HARDWARE.items()}, "launch_seconds": LAUNCH_SECONDS,
                          "sass": "sm_86 compile statistics (bench/kernel_specs.py spec_one) for every card"},
              "method": __doc__.split("\n\n", 3)[3].strip(), "kernels": rows,
              "token_totals": token_totals(rows, HARDWARE)}
    print(table(rows, "rtx3090"))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
