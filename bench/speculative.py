"""Speculative decoding against plain decoding on the same engine: decode tokens/s and acceptance
length for each proposer, in one run.

    python bench/speculative.py                 # CPU, the small Laguna-shaped model of long_context.py

Every model here has random weights, so drafters that must *predict* the target (a separate
draft model, the DFlash drafters) are accepted almost never: their rows measure the overhead of
drafting and verifying, not a speed-up. Two rows show the machinery when drafts are good: the
n-gram drafter on a repetitive prompt, and the target drafting for itself (acceptance ~ the full
width, but a drafter as costly as the target cannot speed anything up). Trained drafters give
the real numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from drafters import save_dflash  # noqa: E402  (random drafters in the public layouts)

from bench.common import write_result  # noqa: E402
from bench.long_context import make_checkpoint  # noqa: E402


def small_llama(folder: Path, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
                     ).save_pretrained(folder)
    return folder


def measure(model, draft, prompt, args) -> dict:
    import lucebox

    llm = lucebox.LLM(model, device=args.device, dtype=args.dtype, draft=draft, max_context=len(prompt) + 512)
    llm.generate(prompt[:32], max_tokens=8, ignore_eos=True)  # warm-up
    runs = [llm.generate(prompt, max_tokens=args.tokens, ignore_eos=True).stats for _ in range(args.repeats)]
    best = max(runs, key=lambda s: s["decode_tokens_per_s"])
    return {key: best[key] for key in ("decode_tokens_per_s", "acceptance_length", "acceptance_by_position",
                                       "rounds", "draft_time_s", "verify_time_s", "width_histogram",
                                       "accepted_histogram")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = tmp / "target"
        make_checkpoint(target)
        cfg = json.loads((target / "config.json").read_text())
        vocab = cfg["vocab_size"]
        g = torch.Generator().manual_seed(0)
        random_prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
        repetitive = (torch.randint(0, vocab, (48,), generator=g).tolist() * 64)[: args.prompt_tokens]
        drafters = {
            "none (autoregressive)": (None, random_prompt),
            "ngram, repetitive prompt": ("ngram", repetitive),
            "none, repetitive prompt": (None, repetitive),
            "ngram, random prompt": ("ngram", random_prompt),
            "draft model (random 2-layer llama)": (small_llama(tmp / "llama", vocab), random_prompt),
            "target as its own drafter": (target, random_prompt),
            "DFlash z-lab layout (random)": (save_dflash(tmp / "zlab", cfg, "zlab", target_layer_ids=(1, 5)),
                                             random_prompt),
            "DFlash Laguna layout (random)": (save_dflash(tmp / "laguna", cfg, "laguna", target_layer_ids=(1, 5)),
                                              random_prompt),
        }
        rows = {}
        for name, (draft, prompt) in drafters.items():
            rows[name] = measure(target, draft, prompt, args)
            r = rows[name]
            print(f"{name:38s} decode {r['decode_tokens_per_s']:7.2f} tok/s  acceptance length "
                  f"{r['acceptance_length']:.2f}", flush=True)

    base = rows["none (autoregressive)"]["decode_tokens_per_s"]
    base_rep = rows["none, repetitive prompt"]["decode_tokens_per_s"]
    for name, r in rows.items():
        r["speedup_vs_autoregressive"] = r["decode_tokens_per_s"] / (base_rep if "repetitive" in name else base)
    path = write_result("speculative", {
        "model": "small Laguna-shaped (bench/long_context.py SMALL_LAGUNA), random weights",
        "device": args.device, "dtype": args.dtype, "generated_tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens, "greedy": True, "results": rows,
        "note": "random weights: trained drafters are needed for real acceptance; see the module docstring",
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
