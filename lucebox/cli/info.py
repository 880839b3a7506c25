"""`lucebox info [MODEL]`: what a model is, from config.json alone (parameters, layers, KV bytes),
and with `--vram` the memory plan under a budget."""

from __future__ import annotations

import json
from collections import Counter

from lucebox.config import RECURRENT_KINDS, ModelConfig
from lucebox.limits import KV_POLICIES, LM_HEADS
from lucebox.models.layout import parameter_counts

_PATTERN = {"full": "F", "sliding": "S", "gdn": "R", "kda": "R"}


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="describe a model from its config.json: parameters, layers, KV bytes")
    p.add_argument("model", nargs="?", default=None,
                   help="model folder, config.json file (no weights are needed), .gguf file or laguna-code-6m "
                        "(default: the built-in model, laguna-code-6m)")
    p.add_argument("--kv-dtype", default="bfloat16",
                   help="dtype of cached K/V for the byte counts (int8: the pool and host KV as int8 rows)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--vram", default=None,
                   help="plan device memory within this budget (e.g. 24GiB), from the config alone: the JSON "
                        "gains a top-level `fits` and `vram_plan` with the bytes of each part (default: no plan)")
    p.add_argument("--quantization", default=None,
                   help="int8 | int4: weights as the engine would quantize them (default: none)")
    p.add_argument("--lm-head", choices=LM_HEADS, default="auto",
                   help="the output head the plan holds: int8 codes with per-row scales, the float table, or "
                        "auto: int8 with --quantization (the Triton kernels read codes) (default: auto)")
    p.add_argument("--ctx", type=int, default=None, help="context to plan for (default: the model's)")
    p.add_argument("--parallel", type=int, default=1,
                   help="sequences run at once (lucebox serve --parallel), each slot's caches counted in the plan "
                        "(default: 1)")
    p.add_argument("--dtype", default="bfloat16", help="activation and unquantized weight dtype for the plan")
    p.add_argument("--kv-policy", choices=KV_POLICIES,
                   help="the policy to plan for (default: exact when the context fits the pool, else select)")


def model_summary(cfg: ModelConfig, kv_dtype_bytes: int = 2, kv_int8: bool = False) -> dict:
    """Parameter counts, layer layout, and KV-cache bytes per token for each attention kind (with
    `kv_int8`, full layers' rows as the int8 pool stores them; sliding rings keep `kv_dtype_bytes`)."""
    total, active = parameter_counts(cfg)
    kinds = Counter((layer.attention, layer.window, layer.num_heads) for layer in cfg.layers)
    attention = []
    for (kind, window, heads), count in sorted(kinds.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        if kind in RECURRENT_KINDS:  # a fixed-size state per sequence, whatever the context
            conv, recurrent = cfg.linear_attention.state_elements()
            attention.append({"kind": kind, "layers": count, "kv_bytes_per_token_per_layer": 0,
                              "state_elements_per_layer": conv + recurrent})
            continue
        per_token = cfg.kv_bytes_per_token(kv_dtype_bytes, kv_int8 and kind == "full")
        attention.append({
            "kind": kind, "layers": count, "query_heads": heads, "window": window,
            "kv_bytes_per_token_per_layer": per_token,
            # A sliding layer never holds more than `window` rows, whatever the context.
            "kv_bytes_max_per_layer": per_token * window if window else None,
        })
    mlp = Counter(layer.mlp for layer in cfg.layers)
    summary = {
        "architecture": cfg.architecture,
        "parameters_total": total,
        "parameters_active": active,
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "attention": attention,
        "mlp": {"dense": mlp.get("dense", 0), "moe": mlp.get("moe", 0)},
        "kv_dtype_bytes": kv_dtype_bytes,
        # F full attention, S sliding, R recurrent (Gated DeltaNet, KDA)
        "layer_pattern": "".join(_PATTERN[layer.attention] for layer in cfg.layers),
    }
    if cfg.moe is not None:
        m = cfg.moe
        summary["moe"] = {"experts": m.num_experts, "top_k": m.top_k, "expert_size": m.expert_size,
                          "shared_expert_size": m.shared_expert_size, "router": m.router}
    return summary


def command(args) -> int:
    import torch

    from lucebox.checkpoints.loading import describe_model
    from lucebox.device import resolve_dtype

    desc = describe_model(args.model)
    cfg = desc.cfg
    int8 = args.kv_dtype == "int8"  # the pool's rows; sliding rings stay in the activations' dtype
    ring_dtype = args.dtype if int8 else args.kv_dtype
    summary = {"folder": str(desc.folder), **model_summary(cfg, resolve_dtype(ring_dtype, torch.device("cpu")).itemsize,
                                                                int8)}
    if desc.gguf is not None:  # every block type lucebox reads is repacked exactly (`checkpoints.gguf.blocks`)
        types = Counter(entry.type_name for entry in desc.gguf.file.tensors.values())
        summary["gguf_tensor_types"] = dict(sorted(types.items()))
    plan = vram_plan(args, desc) if args.vram is not None else None
    if plan is not None:
        summary.update(fits=plan.fits, vram_plan=plan.as_json())
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=True)
    if plan is not None:
        for line in plan.lines():
            out.print(line, markup=False)
    out.print(f"[bold]{summary['architecture']}[/bold]  {summary['layers']} layers, hidden {summary['hidden_size']}, "
              f"vocab {summary['vocab_size']}")
    out.print(f"folder: {summary['folder']}", markup=False)
    out.print(f"parameters: {summary['parameters_total'] / 1e9:.2f}B total, "
              f"{summary['parameters_active'] / 1e9:.2f}B active per token")
    out.print(f"layer pattern (F full, S sliding, R recurrent): {summary['layer_pattern']}")
    for a in summary["attention"]:
        if "state_elements_per_layer" in a:
            out.print(f"  {a['layers']} x {a['kind']} (recurrent): a state of {a['state_elements_per_layer']} "
                      "values per layer, the same at every context length")
            continue
        window = f", window {a['window']}" if a["window"] else ""
        cap = f", at most {a['kv_bytes_max_per_layer'] / 2**20:.2f} MiB per layer" if a["window"] else ""
        out.print(f"  {a['layers']} x {a['kind']} attention, {a['query_heads']} query / {summary['kv_heads']} KV heads "
                  f"x {summary['head_dim']}{window}: KV {a['kv_bytes_per_token_per_layer']} bytes/token/layer{cap}")
    mlp = summary["mlp"]
    line = f"MLP: {mlp['dense']} dense, {mlp['moe']} MoE"
    if "moe" in summary:
        m = summary["moe"]
        shared = f" + shared {m['shared_expert_size']}" if m["shared_expert_size"] else ""
        line += f" ({m['experts']} experts of width {m['expert_size']}, top-{m['top_k']} {m['router']} router{shared})"
    out.print(line)
    if "gguf_tensor_types" in summary:
        counts = ", ".join(f"{n} {kind}" for kind, n in summary["gguf_tensor_types"].items())
        out.print(f"GGUF tensors: {counts} (block types decoded exactly as llama.cpp does)", markup=False)
    return 0


def vram_plan(args, desc):
    """The plan `--vram` asks for, by the planner every engine uses, for a CUDA device."""
    import torch

    from lucebox.checkpoints.loading import resolve_quantization
    from lucebox.device import resolve_dtype
    from lucebox.engine.config import EngineConfig
    from lucebox.engine.setup import plan_for_config
    from lucebox.memory.lm_head import choose_lm_head
    from lucebox.memory.plan import DrafterCost

    config = EngineConfig(args.model, dtype=args.dtype, max_context=args.ctx, kv_policy=args.kv_policy,
                          quantization=args.quantization, vram_budget=args.vram,
                          kv_dtype="int8" if args.kv_dtype == "int8" else "auto", lm_head=args.lm_head,
                          parallel=args.parallel)
    cfg, quantization = desc.cfg, resolve_quantization(config.quantization, desc)
    dtype = resolve_dtype(config.dtype, torch.device("cpu"))
    stored = desc.gguf.device_bytes(cfg, dtype) if desc.gguf is not None else None  # a GGUF's own block types
    lm_head = choose_lm_head(config.lm_head, quantization, "triton", cfg, dtype, stored is not None)  # CUDA's kernels
    return plan_for_config(cfg, config, "cuda", dtype, quantization, DrafterCost(), True, stored, lm_head)
