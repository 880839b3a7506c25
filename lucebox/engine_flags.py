"""The engine flags every command that opens a model shares (`generate`, `chat`, `serve`, `bench`),
mapped 1:1 onto `EngineConfig`'s fields. A flag left out is left to `EngineConfig`'s default,
which its help quotes from there, so each default is written once."""

from __future__ import annotations

import argparse
import re
import sys

from lucebox import limits
from lucebox.engine.config import EngineConfig

# flag -> the EngineConfig field it sets (argparse's dest is the flag's name in snake case)
FIELDS = {
    "--device": "device", "--dtype": "dtype", "--ctx": "max_context", "--kv-pool": "kv_pool_tokens",
    "--kv-policy": "kv_policy", "--kv-reselect-every": "kv_reselect_every", "--draft": "draft",
    "--draft-k": "draft_k", "--draft-ctx": "draft_ctx", "--verify": "verify", "--adaptive": "adaptive",
    "--tree-budget": "tree_budget",
    "--prefill-chunk": "prefill_chunk", "--load-format": "load_format", "--backend": "backend",
    "--cuda-graphs": "cuda_graphs", "--quantization": "quantization", "--vram": "vram_budget",
    "--kv-dtype": "kv_dtype", "--experts-on-host": "experts_on_host", "--expert-slots": "expert_slots",
    "--lm-head": "lm_head",
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The MODEL argument and the flags that choose how it runs."""
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face model folder (config.json + *.safetensors), a .gguf file, or laguna-code-6m "
                        "(default: the built-in model, laguna-code-6m)")
    p.add_argument("--device", help=f"auto | cpu | cuda (default: {EngineConfig.device}: CUDA when present)")
    p.add_argument("--dtype", help="auto | bfloat16 | float16 | float32 | float64 (default: auto: bfloat16 on CUDA, "
                                   "float32 on CPU)")
    p.add_argument("--ctx", type=int, help="max context in tokens (default: the model's max_position_embeddings; "
                                           "more is allowed, with a warning)")
    p.add_argument("--kv-pool", type=int,
                   help="full-attention KV tokens kept on the device per layer; the rest lives in host memory "
                        f"(default: the context, at most {limits.KV_POOL_TOKENS})")
    p.add_argument("--kv-policy", choices=limits.KV_POLICIES,
                   help="exact: attend to every chunk; select: sink + recent + top-scoring chunks, bounded cost "
                        "(default: exact when the context fits the pool, else select)")
    p.add_argument("--kv-reselect-every", type=int, help="committed tokens between select's re-selections "
                                                         f"(default: {limits.KV_RESELECT_EVERY})")
    p.add_argument("--draft",
                   help="speculative decoding: auto (the model's paired drafter, if it ships one, as the built-in "
                        "model does; else its own MTP head, if it has one) | mtp | ngram | none | a drafter folder "
                        "(DFlash or a small model); the output is "
                        f"the target's own either way (default: {EngineConfig.draft})")
    p.add_argument("--no-draft", dest="draft", action="store_const", const="none",
                   help="decode without a drafter (the same as --draft none)")
    p.add_argument("--draft-k", type=int, help=f"most drafts per round, 1..{limits.DRAFT_WIDTH} (default: "
                                               f"{limits.DRAFT_WIDTH}; with --adaptive the width adapts below it)")
    p.add_argument("--draft-ctx", type=int, help=f"tokens of context a drafter keeps (default: {limits.DRAFT_CTX})")
    p.add_argument("--verify", choices=limits.VERIFY_RULES,
                   help="how sampled rounds are verified, each keeping the target's distribution: coupled (the target "
                        "and the drafter race against noise keyed by seed and position, so a seed gives the tokens "
                        "plain decoding gives), tokenwise or block (drawn outcomes) (default: coupled)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction,
                   help="choose each round's width by measured cost, and stop drafting when it does not pay; "
                        "--no-adaptive always verifies --draft-k drafts (default: on)")
    p.add_argument("--tree-budget", type=int,
                   help=f"draft rows of a draft tree verified per round, 0..{limits.DRAFT_WIDTH}, with a DFlash "
                        "drafter (other drafters draft chains); 0: chains "
                        f"(default: {limits.DRAFT_WIDTH}, chains on models with recurrent layers)")
    cpu, cuda = limits.PREFILL_CHUNK["cpu"], limits.PREFILL_CHUNK["cuda"]
    p.add_argument("--prefill-chunk", type=int,
                   help=f"rows per prefill forward (default: {cuda} on CUDA, {cpu} on CPU)")
    p.add_argument("--load-format", help="auto | safetensors | dummy (random weights at the real shapes) "
                                         "(default: auto)")
    p.add_argument("--backend", help="kernels: auto (Triton on CUDA, torch on CPU) | triton | torch (default: auto)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="run decode steps as CUDA graphs; --no-cuda-graphs runs them eagerly, for debugging "
                        "(default: wherever they can run: CUDA, Triton, experts on the device)")
    _add_memory_flags(p)


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """How the weights and caches are held: quantization, the output head, the budget, KV dtype, experts."""
    p.add_argument("--quantization", help="int8 | int4: quantize the linear layers' weights as they load "
                                          "(default: none)")
    p.add_argument("--vram", help="device memory budget, e.g. 24GiB: the planner chooses pool size and prefill chunk "
                                  "to fit it (moving an MoE model's experts to host memory if nothing else fits), or "
                                  "refuses saying what does not fit (default: no budget)")
    p.add_argument("--kv-dtype", choices=limits.KV_DTYPES,
                   help="int8: the full-attention KV pool and its host copies as int8 rows with per-token scales "
                        "(half the host memory and PCIe traffic of bfloat16) (default: auto, the model dtype)")
    p.add_argument("--lm-head", choices=limits.LM_HEADS,
                   help="the output head: float keeps the model dtype's table; int8 reads int8 codes with a "
                        "scale per row (fewer bytes per token); auto: int8 for --quantization on the Triton "
                        "kernels, else float (default: auto)")
    p.add_argument("--experts-on-host", action=argparse.BooleanOptionalAction,
                   help="keep the routed experts in host memory with a device cache of them (default: only when "
                        "--vram needs it)")
    p.add_argument("--expert-slots", type=int,
                   help="experts per MoE layer the device cache holds (default: 8 x top_k, or what --vram leaves)")


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The `EngineConfig` the parsed engine flags describe: only the flags given, the rest left to
    its defaults (`overrides` win)."""
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in FIELDS.items()}
    given = {field: value for field, value in given.items() if value is not None}
    if given.get("draft") == "none":
        given["draft"] = None
    return EngineConfig(args.model, **{**given, **overrides})


def open_engine(args: argparse.Namespace, load_progress=None, **overrides):
    """The `LLM` the flags describe (with --vram, its plan is printed on stderr)."""
    from lucebox import LLM

    llm = LLM.from_config(engine_config(args, **overrides), load_progress, _print_capture_progress)
    if llm.vram_plan is not None:
        print("\n".join(llm.vram_plan.lines()), file=sys.stderr)
    return llm


def _print_capture_progress(done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\rcapturing CUDA graphs: {done}/{total}", end=end, file=sys.stderr, flush=True)


# The flag of each keyword argument the CLI sets (engine flags above, sampling flags of `generate`
# and `chat`), so that an error reads in the user's terms: `kv_pool_tokens=128` -> `--kv-pool 128`.
FLAGS = {
    **{field: flag for flag, field in FIELDS.items()},
    "max_tokens": "--max-tokens", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
    "min_p": "--min-p", "repetition_penalty": "--repetition-penalty", "seed": "--seed",
    "stop token id": "--stop-token-id", "parallel": "--parallel",
}
# Plain words ("the draft model", "a smaller dtype") become flags only in the form `name=value`.
_ALWAYS = {name for name in FLAGS if "_" in name} | {"temperature", "seed", "stop token id", "parallel"}
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
