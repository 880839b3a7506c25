"""Kernels per decoded token of the graphed decode step at the Laguna XS.2 layer pattern.

    TRITON_INTERPRET=1 python bench/kernel_count.py            # prints; --out bench/results writes

Builds Laguna XS.2's config (examples/laguna-xs2) cut to its first five layers (full + dense MLP,
three sliding + MoE, full + MoE: every layer kind XS.2 has), at tiny widths (or `--widths xs2`:
XS.2's hidden size, heads and expert width with 8 experts and a small vocabulary), with random
weights, runs the graphed step body eagerly (as the CPU tests do) and counts every ATen kernel and
Triton launch per layer (`lucebox.benchmark.launches`). Per-token totals for the whole 40-layer
model follow from the counts per layer kind. Launch counts do not depend on the device: the same
ops run inside the CUDA graph on a GPU (only the vendor GEMM's internals may add kernels there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

XS2_CONFIG = ROOT / "examples" / "laguna-xs2" / "config.json"
LAYERS = 5  # full+dense, 3 x sliding+MoE, full+MoE
TINY = dict(hidden_size=128, intermediate_size=256, vocab_size=512, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64, head_dim=32, num_key_value_heads=2,
            heads=(4, 8))
XS2_WIDTHS = dict(hidden_size=2048, intermediate_size=8192, vocab_size=1024, num_experts=8, num_experts_per_tok=8,
                  moe_intermediate_size=512, shared_expert_intermediate_size=512, head_dim=128,
                  num_key_value_heads=8, heads=(48, 64))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", choices=("tiny", "xs2"), default="tiny")
    p.add_argument("--backend", choices=("triton", "torch"), default="triton")
    p.add_argument("--quantization", choices=("int4", "int8", "none"), default="int4")
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the compiled kernels in bfloat16 (the launches are the same)")
    p.add_argument("--out", help="directory to write kernel-count-<machine>.json into (default: print only)")
    return p.parse_args(argv)


def pattern_model(widths: dict) -> Path:
    """XS.2's config cut to its first LAYERS layers at `widths`, in a new temporary folder."""
    config = json.loads(XS2_CONFIG.read_text())
    full_heads, sliding_heads = widths["heads"]
    types = config["layer_types"][:LAYERS]
    config.update({k: v for k, v in widths.items() if k != "heads"}, num_hidden_layers=LAYERS, layer_types=types,
                  mlp_layer_types=config["mlp_layer_types"][:LAYERS], num_attention_heads=full_heads,
                  num_attention_heads_per_layer=[full_heads if t == "full_attention" else sliding_heads
                                                 for t in types])
    folder = Path(tempfile.mkdtemp()) / "laguna-xs2-pattern"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def layer_kind(layer_type: str, mlp_type: str) -> str:
    return f"{layer_type.removesuffix('_attention')}+{'moe' if mlp_type == 'sparse' else mlp_type}"


def count(args) -> dict:
    import lucebox
    from lucebox.benchmark.launches import count_step_launches
    from lucebox.engine.runner import StepRunner

    widths = XS2_WIDTHS if args.widths == "xs2" else TINY
    folder = pattern_model(widths)
    config = json.loads((folder / "config.json").read_text())
    # KVFlash as XS.2 runs at long context: a paged pool smaller than the context, chunks on the host.
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    llm = lucebox.LLM(str(folder), load_format="dummy", device=args.device, dtype=dtype, backend=args.backend,
                      quantization=None if args.quantization == "none" else args.quantization, kv_dtype=args.kv_dtype,
                      max_context=2048, kv_pool_tokens=640, kv_policy="select", prefill_chunk=64)
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    parts = count_step_launches(llm, list(range(1, 21)), tokens=2)
    kinds: dict[str, dict] = {}
    for i, (layer_type, mlp_type) in enumerate(zip(config["layer_types"], config["mlp_layer_types"], strict=True)):
        kinds.setdefault(layer_kind(layer_type, mlp_type), parts[f"layer {i}"])
    xs2 = json.loads(XS2_CONFIG.read_text())
    layers = Counter(layer_kind(t, m) for t, m in zip(xs2["layer_types"], xs2["mlp_layer_types"], strict=True))
    per_kind = {kind: sum(ops.values()) for kind, ops in kinds.items()}
    per_token = (sum(parts["embed"].values()) + sum(parts["head"].values())
                 + sum(per_kind[kind] * n for kind, n in layers.items()))
    return {"widths": args.widths, "device": args.device, "backend": args.backend, "quantization": args.quantization,
            "kv_dtype": args.kv_dtype, "launches_per_layer": per_kind, "xs2_layers_per_kind": dict(layers),
            "launches_per_token_xs2": per_token, "most_per_layer": max(per_kind.values()),
            "embed": parts["embed"], "head": parts["head"], "ops_per_kind": kinds}


def main() -> None:
    args = parse_args()
    if args.backend == "triton" and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    from bench.common import write_result

    result = count(args)
    for kind, n in result["launches_per_layer"].items():
        print(f"{kind:16s} {n:3d} launches per layer  {result['ops_per_kind'][kind]}")
    print(f"embed {sum(result['embed'].values())}, head {sum(result['head'].values())} {result['head']}")
    print(f"Laguna XS.2 ({sum(result['xs2_layers_per_kind'].values())} layers): "
          f"{result['launches_per_token_xs2']} launches per decoded token")
    if args.out:
        print(write_result("kernel-count", result, args.out))


if __name__ == "__main__":
    main()
