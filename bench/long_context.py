"""Decode speed against context length: lucebox `select` and `exact` KVFlash, and transformers'
`generate` on the same checkpoint as the peer, all in one run. The lucebox rows come from the runner
of `lucebox bench` (`lucebox.benchmark.runner`); transformers runs in a subprocess of its own.

    python bench/long_context.py                      # CPU: a small Laguna-shaped model, 1K..64K
    python bench/long_context.py --with-256k          # adds 256K
    python bench/long_context.py --config examples/laguna-xs2 --device cuda --dtype bfloat16 \
        --contexts 1024,4096,16384,65536,131072 --no-peer   # real Laguna XS.2 shapes, random weights

The model is Laguna-shaped (1 full : 3 sliding layers, MoE with a shared expert, YaRN on full
layers) with random weights, so only speed means anything here, not the text.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402

SMALL_LAGUNA = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
    num_attention_heads_per_layer=[4, 8, 8, 8, 4, 8, 8, 8], num_key_value_heads=2, head_dim=32,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 2,
    mlp_layer_types=["dense"] + ["sparse"] * 7, sliding_window=512, num_experts=32, num_experts_per_tok=4,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, moe_routed_scaling_factor=2.5,
    max_position_embeddings=262144, gating=True,
    rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                           "original_max_position_embeddings": 8192, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
)

PEER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer
folder, ctx, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(int(sys.argv[5]))
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(seed))
class Clock(BaseStreamer):
    def __init__(self): self.times = []
    def put(self, value): self.times.append(time.perf_counter())
    def end(self): pass
clock = Clock()
start = time.perf_counter()
with torch.no_grad():
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock, pad_token_id=0)
first, last = clock.times[1], clock.times[-1]   # times[0] is the prompt
print(json.dumps({"depth": ctx, "decode_tokens_per_s": (n - 1) / (last - first),
                  "prefill_s": first - start, "generated_tokens": n}))
"""


def make_checkpoint(folder: Path) -> None:
    from transformers import LagunaConfig, LagunaForCausalLM

    torch.manual_seed(0)
    LagunaForCausalLM(LagunaConfig(**SMALL_LAGUNA)).save_pretrained(folder)


def run_lucebox(model, policy, contexts, args) -> list[dict]:
    """The rows of `lucebox bench` (one code path measures): plain decoding, one row per context,
    each prefilled from an empty cache and decoded `--decode-tokens` tokens, `--repeats` times."""
    from lucebox.benchmark.runner import BenchSettings, run_benchmark
    from lucebox.engine.config import EngineConfig

    engine = EngineConfig(model, device=args.device, dtype=args.dtype, load_format=args.load_format, kv_policy=policy,
                          kv_pool_tokens=args.kv_pool, prefill_chunk=args.prefill_chunk)
    settings = BenchSettings(depths=tuple(contexts), gen=args.decode_tokens, repeat=args.repeats, seed=args.seed)
    rows = run_benchmark(engine, settings)["rows"]
    for row in rows:
        print(f"lucebox {policy:6s} ctx {row['depth']:>7}: decode {row['decode_tokens_per_s']:8.2f} tok/s (median of "
              f"{args.repeats}), prefill {row['prefill_tokens_per_s']:8.1f} tok/s", flush=True)
    return rows


def run_peer(folder, contexts, args) -> list[dict]:
    rows = []
    for ctx in contexts:
        cmd = [sys.executable, "-c", PEER, str(folder), str(ctx), str(args.decode_tokens), str(args.seed),
               str(torch.get_num_threads())]
        started = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
            if out.returncode == 0:
                row = json.loads(out.stdout.strip().splitlines()[-1])
            elif out.returncode == -9:
                row = {"depth": ctx, "error": "killed by the kernel (SIGKILL): out of memory on this machine"}
            else:
                tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
                row = {"depth": ctx, "error": f"exit {out.returncode}: {tail[:300]}"}
        except subprocess.TimeoutExpired:
            row = {"depth": ctx, "error": f"did not finish within {args.peer_timeout} s"}
        row["wall_s"] = time.perf_counter() - started
        rows.append(row)
        rate = row.get("decode_tokens_per_s")
        print(f"transformers   ctx {ctx:>7}: " + (f"decode {rate:8.2f} tok/s" if rate else row["error"]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,4096,16384,65536")
    p.add_argument("--with-256k", action="store_true", help="add a 262144-token context")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="requests per context (lucebox), each prefilled afresh; the median is kept")
    p.add_argument("--kv-pool", type=int, default=1024, help="device KV pool in tokens (select and exact)")
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--config", default=None, help="a model folder or config.json (default: a small Laguna-shaped one)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--peer-timeout", type=int, default=900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                               "bench/results replaces the committed result)")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")] + ([262144] if args.with_256k else [])

    with tempfile.TemporaryDirectory() as tmp:
        model = args.config
        if model is None:
            model = Path(tmp) / "laguna-small"
            make_checkpoint(model)
        results = {policy: run_lucebox(model, policy, contexts, args) for policy in ("select", "exact")}
        peer = [] if args.no_peer or args.load_format == "dummy" else run_peer(model, contexts, args)

    def rate(rows, ctx):
        return next((r.get("decode_tokens_per_s") for r in rows if r["depth"] == ctx), None)

    summary = {
        "select_flatness_last_over_first": rate(results["select"], contexts[-1]) / rate(results["select"], contexts[0]),
        "speedup_vs_transformers": {
            policy: {ctx: (rate(rows, ctx) / rate(peer, ctx) if rate(peer, ctx) else None) for ctx in contexts}
            for policy, rows in results.items()
        } if peer else None,
    }
    path = write_result("long_context", {
        "model": str(args.config or "small Laguna-shaped (bench/long_context.py SMALL_LAGUNA), random weights"),
        "model_config": None if args.config else SMALL_LAGUNA,
        "device": args.device, "dtype": args.dtype, "kv_pool_tokens": args.kv_pool,
        "decode_tokens": args.decode_tokens, "contexts": contexts,
        "lucebox": results, "transformers": peer, "summary": summary,
    }, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
