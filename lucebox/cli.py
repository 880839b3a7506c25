"""The `lucebox` command. Every LuceboxError becomes one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys

from lucebox.errors import LuceboxError


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--draft", default=None,
                   help="speculative decoding: auto (the model's paired drafter, if it ships one) | ngram | none | "
                        "a drafter folder (DFlash or a small model); default: none")
    p.add_argument("--draft-k", type=int, default=15, help="most drafts per round (1..15; the width adapts)")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lucebox", description="Single-GPU inference for big open MoE models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="describe a model from its config.json: parameters, layers, KV bytes")
    info.add_argument("model", nargs="?", default=None,
                      help="model folder, or a config.json file (no weights are needed); default: the built-in model")
    info.add_argument("--kv-dtype", default="bfloat16", help="dtype of cached K/V for the byte counts")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")

    gen = sub.add_parser("generate", help="generate text (or token ids) from a prompt")
    _add_engine_flags(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--token-ids", help="prompt as comma-separated token ids (for models without a tokenizer)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string, never printed (repeatable); "
                     "for a newline use the shell's quoting, e.g. $'\\n\\n'")
    gen.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    from lucebox.training import distill_command, train_command

    train_command.add_parser(sub)
    distill_command.add_parser(sub)
    return parser


def _info(args) -> int:
    import torch

    from lucebox.device import resolve_dtype
    from lucebox.info import model_summary
    from lucebox.loading import describe_model

    if args.model is None:
        from lucebox.builtin import builtin_model

        args.model = builtin_model()
    cfg = describe_model(args.model).cfg
    summary = model_summary(cfg, resolve_dtype(args.kv_dtype, torch.device("cpu")).itemsize)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=True)
    out.print(f"[bold]{summary['architecture']}[/bold]  {summary['layers']} layers, hidden {summary['hidden_size']}, "
              f"vocab {summary['vocab_size']}")
    out.print(f"parameters: {summary['parameters_total'] / 1e9:.2f}B total, "
              f"{summary['parameters_active'] / 1e9:.2f}B active per token")
    out.print(f"layer pattern (F full, S sliding): {summary['layer_pattern']}")
    for a in summary["attention"]:
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
    return 0


def _generate(args) -> int:
    from lucebox import LLM
    from lucebox.errors import InvalidArgumentError

    prompt = args.prompt
    if args.token_ids is not None:
        try:
            prompt = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise InvalidArgumentError("--token-ids must be comma-separated integers, e.g. 1,2,3") from None
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, max_context=args.ctx,
              kv_pool_tokens=args.kv_pool, kv_policy=args.kv_policy, prefill_chunk=args.prefill_chunk,
              draft=None if args.draft == "none" else args.draft, draft_k=args.draft_k, verify=args.verify,
              backend=args.backend,
              quantization=args.quantization, cuda_graphs=False if args.no_cuda_graphs else None)
    last = None
    for chunk in llm.stream(prompt, max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=[*args.stop, *args.stop_token_id], ignore_eos=args.ignore_eos):
        piece = chunk.text if chunk.text is not None else "".join(f"{t} " for t in chunk.token_ids)
        sys.stdout.write(piece)
        sys.stdout.flush()
        last = chunk
    s = last.stats
    spec = f", acceptance length {s['acceptance_length']:.2f}" if llm.proposer is not None else ""
    print(f"\n[{s['generated_tokens']} tokens, finish: {last.finish_reason}, prefill {s['prefill_tokens_per_s']:.1f} "
          f"tok/s, decode {s['decode_tokens_per_s']:.1f} tok/s{spec}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        from lucebox.training import distill_command, train_command

        commands = {"info": _info, "generate": _generate, "train": train_command.command,
                    "distill": distill_command.command}
        return commands[args.command](args)
    except LuceboxError as e:
        print(f"lucebox: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lucebox: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
