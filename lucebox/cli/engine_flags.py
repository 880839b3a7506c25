"""The engine flags every CLI command shares (`generate`, `chat`, `bench`), mapped 1:1 onto `LLM`'s
keyword arguments, so each command opens its engine the same way."""

from __future__ import annotations

import argparse
import re
import sys


def add_engine_flags(p: argparse.ArgumentParser, draft_default: str = "none") -> None:
    """The MODEL argument and the flags that choose how it runs."""
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model folder (config.json + *.safetensors); default: the built-in model")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 | float64")
    p.add_argument("--ctx", type=int, default=None, help="max context in tokens (default: the model's)")
    p.add_argument("--kv-pool", type=int, default=None,
                   help="full-attention KV tokens kept on the device; the rest lives in host memory (default 8192)")
    p.add_argument("--kv-policy", choices=["exact", "select"], default=None,
                   help="exact: attend to every chunk; select: sink + recent + top-scoring chunks, bounded cost "
                        "(default: exact when the context fits the pool, else select)")
    p.add_argument("--draft", default=draft_default,
                   help="speculative decoding: auto (the model's paired drafter, if it ships one) | ngram | none | "
                        f"a drafter folder (DFlash or a small model); default: {draft_default}")
    p.add_argument("--draft-k", type=int, default=15, help="most drafts per round (1..15; the width adapts)")
    p.add_argument("--draft-ctx", type=int, default=4096,
                   help="tokens of context a drafter keeps (its ring; default 4096)")
    p.add_argument("--verify", choices=["tokenwise", "block"], default="tokenwise",
                   help="how sampled drafts are verified (both keep the target's distribution)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="rows per prefill forward (default 2048 CUDA, 512 CPU)")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | dummy (random weights)")
    p.add_argument("--backend", default="auto",
                   help="kernels: auto (Triton on CUDA, torch on CPU) | triton | torch")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (for debugging)")
    p.add_argument("--quantization", default=None,
                   help="int8 | int4: quantize the linear layers' weights as they load (default: none)")
    p.add_argument("--vram", default=None,
                   help="device memory budget, e.g. 24GiB: the planner chooses pool size and prefill chunk to fit "
                        "it (moving an MoE model's experts to host memory if nothing else fits), or refuses "
                        "saying what does not fit")
    p.add_argument("--kv-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: the full-attention KV pool and its host copies as int8 rows with per-token scales "
                        "(half the host memory and PCIe traffic of bfloat16); default: the model dtype")
    p.add_argument("--experts-on-host", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the routed experts in host memory with a device cache of them (default: only when "
                        "--vram needs it)")
    p.add_argument("--expert-slots", type=int, default=None,
                   help="experts per MoE layer the device cache holds (default 8 x top_k, or what --vram leaves)")


def engine_options(args: argparse.Namespace, **overrides) -> dict:
    """`LLM` keyword arguments from the parsed engine flags (`overrides` win)."""
    options = dict(device=args.device, dtype=args.dtype, load_format=args.load_format, max_context=args.ctx,
                   kv_pool_tokens=args.kv_pool, kv_policy=args.kv_policy, prefill_chunk=args.prefill_chunk,
                   draft=None if args.draft in (None, "none") else args.draft, draft_k=args.draft_k,
                   draft_ctx=args.draft_ctx, verify=args.verify, backend=args.backend,
                   quantization=args.quantization, cuda_graphs=False if args.no_cuda_graphs else None,
                   vram_budget=args.vram, experts_on_host=args.experts_on_host, expert_slots=args.expert_slots,
                   kv_dtype=args.kv_dtype)
    options.update(overrides)
    return options


def open_engine(args: argparse.Namespace, **overrides):
    """The `LLM` the flags describe (with --vram, its plan is printed on stderr)."""
    from lucebox import LLM

    return report_plan(LLM(args.model, **engine_options(args, **overrides)))


def report_plan(llm):
    """Print the engine's VRAM plan, if it was planned under a budget, on stderr; returns `llm`."""
    if llm.vram_plan is not None:
        print("\n".join(llm.vram_plan.lines()), file=sys.stderr)
    return llm


# The flag of each keyword argument the CLI sets (engine flags above, sampling flags of `generate`
# and `chat`), so that an error reads in the user's terms: `kv_pool_tokens=128` -> `--kv-pool 128`.
FLAGS = {
    "max_context": "--ctx", "kv_pool_tokens": "--kv-pool", "kv_policy": "--kv-policy", "draft_k": "--draft-k",
    "draft_ctx": "--draft-ctx", "prefill_chunk": "--prefill-chunk", "load_format": "--load-format",
    "max_tokens": "--max-tokens", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
    "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
    "stop token id": "--stop-token-id",
    "device": "--device", "dtype": "--dtype", "draft": "--draft", "verify": "--verify", "backend": "--backend",
    "quantization": "--quantization", "vram_budget": "--vram", "experts_on_host": "--experts-on-host",
    "expert_slots": "--expert-slots", "kv_dtype": "--kv-dtype",
}
# Plain words ("the draft model", "a smaller dtype") become flags only in the form `name=value`.
_ALWAYS = {name for name in FLAGS if "_" in name} | {"temperature", "seed", "stop token id"}
_NAMED = re.compile(r"(?<![\w./-])(?P<name>" + "|".join(sorted(FLAGS, key=len, reverse=True))
                    + r")(?:=(?P<value>'[^']*'|[^\s'\",;:)]+))?(?![\w/-]|\.\w)")


def in_flag_terms(message: str) -> str:
    """`message` with each keyword argument named as its CLI flag (`max_context=4096` -> `--ctx 4096`,
    `prefill_chunk` -> `--prefill-chunk`); paths and other words are left alone."""

    def flag(m: re.Match) -> str:
        name, value = m.group("name"), m.group("value")
        if value is not None:
            return FLAGS[name] + " " + value.strip("'")
        return FLAGS[name] if name in _ALWAYS else m.group(0)

    return _NAMED.sub(flag, message)
