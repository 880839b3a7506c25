"""Decode speed of a Qwen3-Next-shaped hybrid (Gated DeltaNet + full attention) against context
length: the recurrent layers carry a fixed-size state, so their cost per decoded token is the same
at 1K and at 32K; only the full-attention layers read a cache that grows with the context.

    python bench/hybrid_context.py                       # CPU: 8 layers (6 GDN, 2 full), 1K..32K
    python bench/hybrid_context.py --out bench/results   # replace the committed result

The model is written here as a config.json and opened with random weights (load_format="dummy"),
so only speed means anything, not the text. Each request prefills a fresh random prompt (prefill
time is not the figure), then decodes `--decode-tokens` tokens greedily with ignore_eos; decode
tokens/s comes from `Generation.stats`, the median of `--repeats` rounds over all the contexts. In
the same requests, the time spent in each kind of token mixer on one-token decode steps is clocked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402


def hybrid_config(hidden: int) -> dict:
    """A small Qwen3-Next: 8 layers, every 4th full attention (6 GDN, 2 full), dense MLPs."""
    head = hidden // 4
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 8192,
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": 8, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": head, "linear_value_head_dim": head,
        "linear_conv_kernel_dim": 4, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25, "torch_dtype": "float32",
    }


class MixerClock:
    """Seconds spent in each layer's token mixer on one-token (decode) steps, summed by kind."""

    def __init__(self, decoder):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.layers = defaultdict(int)
        for i, mixer in enumerate(decoder.mixers):
            kind = "recurrent" if decoder.cfg.layers[i].is_recurrent else "attention"
            self.layers[kind] += 1
            mixer.mix = self._timed(mixer.mix, kind)

    def _timed(self, mix, kind: str):
        def timed(h: torch.Tensor, context) -> torch.Tensor:
            if h.shape[0] != 1:  # a prefill chunk: not what is measured
                return mix(h, context)
            start = time.perf_counter()
            out = mix(h, context)
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            return out
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per decode step in all layers of each kind, and per layer."""
        out = {}
        for kind, layers in self.layers.items():
            steps = self.calls[kind] / layers
            total = 1e3 * self.seconds[kind] / steps if steps else 0.0
            out[f"{kind}_ms_per_step"] = total
            out[f"{kind}_ms_per_layer"] = total / layers
        return out


def request(llm, clock: MixerClock, ctx: int, args, generator: torch.Generator) -> dict:
    """One request on a fresh random prompt (so no cache is reused): its decode and prefill rates
    and the mixers' decode time."""
    prompt = torch.randint(0, llm.config.vocab_size, (ctx,), generator=generator).tolist()
    clock.reset()
    g = llm.generate(prompt, max_tokens=args.decode_tokens, ignore_eos=True, temperature=0.0)
    return {"decode": g.stats["decode_tokens_per_s"], "prefill": g.stats["prefill_tokens_per_s"],
            **clock.per_step_ms()}


def row_of(ctx: int, samples: list[dict]) -> dict:
    rates = [s["decode"] for s in samples]
    row = {"context": ctx, "decode_tokens_per_s": statistics.median(rates), "decode_tokens_per_s_min": min(rates),
           "decode_tokens_per_s_max": max(rates),
           "prefill_tokens_per_s": statistics.median(s["prefill"] for s in samples),
           **{k: statistics.median(s[k] for s in samples) for k in samples[0] if k.endswith(("_step", "_layer"))}}
    print(f"ctx {ctx:>6}: decode {row['decode_tokens_per_s']:7.2f} tok/s (median of {len(samples)}), GDN "
          f"{row['recurrent_ms_per_step']:.3f} ms/step, full attention {row['attention_ms_per_step']:.3f} ms/step, "
          f"prefill {row['prefill_tokens_per_s']:.0f} tok/s", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="requests per context, each on a fresh prompt; median kept")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--kv-policy", default=None, help="the engine's kv_policy (default: the engine's own choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                               "bench/results replaces the committed result)")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    import lucebox

    config = hybrid_config(args.hidden)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        llm = lucebox.LLM(tmp, load_format="dummy", device="cpu", dtype="float32", kv_policy=args.kv_policy,
                          max_context=max(contexts) + args.decode_tokens)
        clock = MixerClock(llm.engine.decoder)
        generator = torch.Generator().manual_seed(args.seed)
        llm.generate(torch.randint(0, config["vocab_size"], (64,), generator=generator).tolist(),
                     max_tokens=args.decode_tokens, ignore_eos=True, temperature=0.0)  # warm-up, not recorded
        # Round after round over every context, so a drift in the machine's speed hits each alike.
        samples: dict[int, list[dict]] = {ctx: [] for ctx in contexts}
        for r in range(args.repeats):
            for ctx in contexts:
                samples[ctx].append(request(llm, clock, ctx, args, generator))
                print(f"round {r + 1}/{args.repeats} ctx {ctx:>6}: decode {samples[ctx][-1]['decode']:7.2f} tok/s",
                      flush=True)
        rows = [row_of(ctx, samples[ctx]) for ctx in contexts]
        cache = llm.setup.cache

    rates = [r["decode_tokens_per_s"] for r in rows]
    summary = {
        "decode_max_over_min": max(rates) / min(rates),
        "decode_last_over_first": rates[-1] / rates[0],
        "recurrent_ms_per_step_last_over_first": rows[-1]["recurrent_ms_per_step"] / rows[0]["recurrent_ms_per_step"],
        "attention_ms_per_step_last_over_first": rows[-1]["attention_ms_per_step"] / rows[0]["attention_ms_per_step"],
        "wall_s": time.perf_counter() - started,
    }
    path = write_result("hybrid_context", {
        "model": "small Qwen3-Next-shaped (bench/hybrid_context.py hybrid_config), random weights",
        "model_config": config, "layers": dict(clock.layers), "device": "cpu", "dtype": "float32",
        "kv_policy": cache.kv_policy, "kv_pool_tokens": cache.kv_pool_tokens, "max_context": cache.max_context,
        "decode_tokens": args.decode_tokens, "repeats": args.repeats, "contexts": contexts,
        "rows": rows, "summary": summary,
    }, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
