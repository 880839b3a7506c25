"""A roofline model of decode tokens/s: Laguna XS.2 (int4 and bf16 weights) on an RTX 3090, an RTX
4090, an H100 and an H200 at 1K / 32K / 128K of context, from CPU-side figures only (no GPU was used).

    python bench/roofline.py                                    # prints the table and the JSON
    python bench/roofline.py --specs bench/results/kernel-specs-sm86-before.json \\
        --kernels-per-token 1800 --out bench/results/roofline.json

time per token = max(bytes moved per token / bandwidth,
                     sum over kinds of bytes x SASS warp instructions per byte / issue rate)
                 + kernels per token x cost of one dependent launch inside a CUDA graph

Bytes per token come from the model config (`lucebox.models.layout.weight_shapes`, the shapes the
engine loads): every weight but the unchosen routed experts (top_k / num_experts of each stack),
one embedding row, and the KV read at the context (sliding layers min(window, context) tokens,
full layers what the engine's pool makes the attention kernel load: the context under `exact`, the
whole `select` pool past it, as `CacheSettings.for_engine` sizes it, or --kvflash-tokens' pool).
int4 weights are the engine's codes and float16 group scales (`quantized_bytes`); the output head,
embedding and norms stay bf16, as `quantization=` leaves them, and routers float32 (their stored
dtype, kernels/moe.py `routing_dtype`). Per kernel: bench/roofline_kernels.py. The issue rate is SMs x warp
schedulers x clock warp instructions a second (one issue a scheduler a cycle, every SM busy).
Instructions per byte (by kind: "linear" quantized projections, "experts" MoE weights, "kv"
attention) come from `bench/kernel_specs.py` output; kinds without one (plain bf16 projections on
the vendor GEMM, norms) count as bandwidth-bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Hardware:
    bandwidth: float  # bytes/s
    sms: int
    clock_hz: float  # boost clock
    schedulers_per_sm: int
    memory_bytes: int
    source: str
    warps_per_sm: int = 48  # resident warps an SM holds (sm_86/sm_89: 48, sm_90: 64)
    shared_per_sm: int = 100 * 1024  # shared memory an SM gives its blocks (sm_86/sm_89: 100 KB, sm_90: 228 KB)

    @property
    def issue_rate(self) -> float:
        """Warp instructions a second with every scheduler issuing one a cycle."""
        return self.sms * self.schedulers_per_sm * self.clock_hz


# Assumed from vendor specifications (none measured here).
HARDWARE = {
    "rtx3090": Hardware(936e9, 82, 1.695e9, 4, 24 << 30, "NVIDIA GeForce RTX 3090 spec: 936 GB/s GDDR6X, 82 SMs, "
                        "1.695 GHz boost, 4 warp schedulers per SM (GA102 whitepaper), 24 GiB"),
    "rtx4090": Hardware(1008e9, 128, 2.52e9, 4, 24 << 30, "NVIDIA GeForce RTX 4090 spec: 1008 GB/s GDDR6X, 128 SMs, "
                        "2.52 GHz boost, 4 warp schedulers per SM (Ada whitepaper), 24 GiB"),
    "h100": Hardware(3.35e12, 132, 1.98e9, 4, 80 * 10**9, "NVIDIA H100 SXM spec: 3.35 TB/s HBM3, 132 SMs, "
                     "1.98 GHz boost, 4 warp schedulers per SM (Hopper whitepaper), 80 GB", 64, 228 * 1024),
    "h200": Hardware(4.8e12, 132, 1.98e9, 4, 141 * 10**9, "NVIDIA H200 SXM spec: 4.8 TB/s HBM3e, 132 SMs, "
                     "1.98 GHz boost, 4 warp schedulers per SM (Hopper whitepaper), 141 GB", 64, 228 * 1024),
}
CONTEXTS = (1024, 32768, 131072)
LAUNCH_SECONDS = 2.0e-6
LAUNCH_SOURCE = ("assumed: ~1.5-2.5 us from one kernel's end to the next dependent one's start inside a CUDA "
                 "graph (commonly reported for Ampere/Hopper graph replays); 2.0 us is the middle, not measured")
KERNELS_PER_TOKEN = 1800  # today's engine, from the issue; the target is <= 500


def parameter_bytes(shape: tuple[int, ...], fmt: str, quantized: bool) -> int:
    from lucebox.kernels.quant import quantized_bytes

    n = 1
    for size in shape:
        n *= size
    return quantized_bytes(shape, fmt) if fmt != "bf16" and quantized else 2 * n


def full_layer_kv_tokens(context: int, kv_pool_tokens: int | None = None) -> int:
    """KV rows a full-attention layer's decode step reads at `context`: the whole context when the
    engine's pool holds it (`exact`), else the `select` pool, whose every live row the attention
    kernel loads (the pinned mask applies after the load). The engine's own settings decide."""
    from lucebox.caches.settings import CacheSettings
    from lucebox.limits import PREFILL_CHUNK

    settings = CacheSettings.for_engine(context, PREFILL_CHUNK["cuda"], kv_pool_tokens=kv_pool_tokens).kvflash()
    return min(context, settings.pool_chunks * settings.chunk) if settings.policy == "select" else context


def bytes_per_token(cfg, fmt: str, context: int, kvflash_tokens: int | None = None) -> dict:
    """{kind: {"bits": ..., "bytes": ...}} one decode token reads; kinds as in the module doc."""
    from lucebox.models.layout import quantizable, weight_shapes

    moe = cfg.moe
    kinds: dict[str, dict] = {}

    def add(kind: str, bits: int, nbytes: float) -> None:
        entry = kinds.setdefault(kind, {"bits": bits, "bytes": 0})
        entry["bytes"] += int(nbytes)

    bits = 16 if fmt == "bf16" else int(fmt[3:])
    for name, shape in weight_shapes(cfg).items():
        part = name.rsplit(".", 1)[-1]
        quantized = quantizable(name) and fmt != "bf16"
        size = parameter_bytes(shape, fmt, quantizable(name))
        if part in ("experts_gate_up", "experts_down"):
            add("experts", bits, size * moe.top_k / moe.num_experts)
        elif part in ("shared_gate_up", "shared_down"):  # rides in the MoE kernels' launches
            add("experts", bits, size)
        elif part in ("router", "router_bias"):  # stored in float32 (kernels/moe.py routing_dtype)
            add("vendor_gemv" if part == "router" else "norms", 32, size * 2)
        elif part == "embed":
            add("embedding_row", 16, size / shape[0])
        elif len(shape) >= 2:
            add("linear" if quantized else "vendor_gemv", bits if quantized else 16, size)
        else:
            add("norms", 16, size)
    row = cfg.kv_bytes_per_token(2)  # one layer's bf16 K and V of one token
    for layer in cfg.layers:
        tokens = min(context, layer.window) if layer.window else full_layer_kv_tokens(context, kvflash_tokens)
        add("kv", 16, tokens * row)
    return kinds


def total_weight_bytes(cfg, fmt: str) -> int:
    from lucebox.models.layout import quantizable, weight_shapes

    return sum(parameter_bytes(shape, fmt, quantizable(name)) for name, shape in weight_shapes(cfg).items())


def instructions_per_byte(specs: dict | None, kind: str, bits: int) -> float | None:
    """The worst figure for this kind and width with bf16 activations among the specializations a
    one-token decode step launches (constexpr M or T specialized to 1) with the engine's default
    symmetric int4 (OFFSET 0), when the specs list has such launches; else the kernel_specs
    summary's worst over every decode specialization (verify blocks and zero points included)."""
    if specs is None:
        return None
    one_row = [spec["instructions_per_byte"] for spec in specs.get("specs", [])
               if spec.get("role") == kind and spec.get("bits") == bits and spec.get("activation") == "bf16"
               and "instructions_per_byte" in spec and _one_token(spec["constexprs"])]
    if one_row:
        return max(one_row)
    entry = specs.get("summary", {}).get(kind, {}).get(str(bits), {}).get("bf16")
    return entry["instructions_per_byte"] if entry else None


def _one_token(constexprs: dict) -> bool:
    return 1 in (constexprs.get("M"), constexprs.get("T")) and constexprs.get("OFFSET", 0) == 0


def predict(hw: Hardware, kinds: dict, specs: dict | None, kernels_per_token: int, launch_seconds: float) -> dict:
    total = sum(k["bytes"] for k in kinds.values())
    bandwidth_s = total / hw.bandwidth
    figures = {name: instructions_per_byte(specs, name, k["bits"]) for name, k in kinds.items()}
    instruction_s = sum(k["bytes"] * (figures[name] or 0.0) for name, k in kinds.items()) / hw.issue_rate
    launch_s = kernels_per_token * launch_seconds
    seconds = max(bandwidth_s, instruction_s) + launch_s
    return {"bytes_per_token": total, "bytes_by_kind": {n: k["bytes"] for n, k in kinds.items()},
            "instructions_per_byte": figures, "bandwidth_s": bandwidth_s, "instruction_s": instruction_s,
            "launch_s": launch_s, "seconds_per_token": seconds, "tokens_per_s": 1 / seconds,
            "tokens_per_s_without_launches": 1 / max(bandwidth_s, instruction_s),
            "bound": "instructions" if instruction_s > bandwidth_s else "bandwidth",
            "bandwidth_roofline_tokens_per_s": 1 / bandwidth_s}


def model(cfg, specs: dict | None, kernels_per_token: int, launch_seconds: float, contexts=CONTEXTS,
          kvflash_tokens: int | None = None, hardware: dict = HARDWARE) -> list[dict]:
    """One prediction per hardware, weight format and context; a format whose weights and KV do not
    fit the card's memory is reported as not fitting, without a prediction."""
    rows = []
    for hw_name, hw in hardware.items():
        for fmt in ("int4", "bf16"):
            weights = total_weight_bytes(cfg, fmt)
            for context in contexts:
                kv = sum(min(context, layer.window or context) for layer in cfg.layers) * cfg.kv_bytes_per_token(2)
                row = {"hardware": hw_name, "weights": fmt, "context": context, "weight_bytes": weights,
                       "kv_cache_bytes": kv, "fits": weights + kv <= hw.memory_bytes}
                if row["fits"]:
                    kinds = bytes_per_token(cfg, fmt, context, kvflash_tokens)
                    row.update(predict(hw, kinds, specs, kernels_per_token, launch_seconds))
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'hardware':<8} {'weights':<7} {'context':>7} {'MB/token':>9} {'bw us':>7} {'instr us':>8} "
             f"{'launch us':>9} {'tok/s':>7} {'no-launch':>9} {'bound':<12}"]
    for r in rows:
        head = f"{r['hardware']:<8} {r['weights']:<7} {r['context']:>7} "
        if not r["fits"]:
            lines.append(head + f"does not fit ({(r['weight_bytes'] + r['kv_cache_bytes']) / 2**30:.1f} GiB)")
            continue
        lines.append(head + f"{r['bytes_per_token'] / 1e6:>9.1f} {r['bandwidth_s'] * 1e6:>7.0f} "
                     f"{r['instruction_s'] * 1e6:>8.0f} {r['launch_s'] * 1e6:>9.0f} {r['tokens_per_s']:>7.1f} "
                     f"{r['tokens_per_s_without_launches']:>9.1f} {r['bound']:<12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from lucebox.models import build_model_config

    from lucebox.benchmark.record import commit, utc_now

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "examples" / "laguna-xs2"), help="model folder (config.json)")
    p.add_argument("--specs", default=None, help="bench/kernel_specs.py JSON: instructions per byte by kind")
    p.add_argument("--kernels-per-token", type=int, default=KERNELS_PER_TOKEN)
    p.add_argument("--launch-us", type=float, default=LAUNCH_SECONDS * 1e6, help="per dependent graph node")
    p.add_argument("--kvflash-tokens", type=int, default=None, help="the select pool's tokens (default: the engine's)")
    p.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    args = p.parse_args(argv)
    cfg = build_model_config(json.loads((Path(args.config) / "config.json").read_text()))
    specs = json.loads(Path(args.specs).read_text()) if args.specs else None
    rows = model(cfg, specs, args.kernels_per_token, args.launch_us * 1e-6, kvflash_tokens=args.kvflash_tokens)
    folder = Path(args.config).resolve()
    config_name = str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else args.config
    record = {
        "benchmark": "roofline", "date": utc_now(), "commit": commit(),
        "command": " ".join(["python", "bench/roofline.py", *(argv if argv is not None else sys.argv[1:])]),
        "gpu_measurements": "none: every figure here is a model, nothing was run on a GPU",
        "computed": f"bytes per token from {config_name}/config.json (the shapes lucebox loads)",
        "measured": {"instructions_per_byte": f"CPU compile statistics (sm_86 SASS) from {args.specs}"
                     if specs else "not given: instruction-bound time is 0",
                     "specs_commit": specs.get("commit") if specs else None},
        "assumed": {"hardware": {k: asdict(v) for k, v in HARDWARE.items()},
                    "launch_seconds": args.launch_us * 1e-6, "launch_source": LAUNCH_SOURCE,
                    "instructions_per_byte_choice": "per kind and width: the worst one-token (M or T = 1) "
                    "symmetric-int4 specialization with bf16 activations when the specs list has one (the slower of "
                    "MoE up/down); else the worst decode specialization (kernel_specs summary, zero points and "
                    "verify blocks included)",
                    "kernels_per_token": args.kernels_per_token,
                    "kernels_per_token_source": "given: bench/kernel_count.py's launches_per_token_xs2 (~1,800 before "
                    "the fusions, per the issue)",
                    "issue_rate": "SMs x schedulers x clock warp instructions/s; sm_86 instructions per byte are "
                                  "used for the H200 too (its sm_90 SASS may differ)",
                    "kv": "bf16 K and V; full layers read the context, or past the pool the whole select pool of "
                          + (f"{args.kvflash_tokens} tokens" if args.kvflash_tokens else "the engine's size")},
        "model": {"config": config_name, "layers": len(cfg.layers), "experts": cfg.moe.num_experts,
                  "top_k": cfg.moe.top_k},
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "predictions": rows,
    }
    print(table(rows))
    text = json.dumps(record, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
