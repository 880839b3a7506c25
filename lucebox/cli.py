"""The `lucebox` command. Every LuceboxError becomes one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from lucebox import __version__
from lucebox.engine_flags import add_engine_flags, in_flag_terms, open_engine
from lucebox.errors import LuceboxError
from lucebox.stats_line import stats_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lucebox", description="Single-GPU inference for big open MoE models.")
    parser.add_argument("--version", action="version", version=f"lucebox {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="describe a model from its config.json: parameters, layers, KV bytes")
    info.add_argument("model", nargs="?", default=None,
                      help="model folder, or a config.json file (no weights are needed); default: the built-in model")
    info.add_argument("--kv-dtype", default="bfloat16",
                      help="dtype of cached K/V for the byte counts (int8: the pool and host KV as int8 rows)")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--vram", default=None,
                      help="plan device memory within this budget (e.g. 24GiB), from the config alone: the JSON "
                           "gains a top-level `fits` and `vram_plan` with the bytes of each part")
    info.add_argument("--quantization", default=None, help="int8 | int4: weights as the engine would quantize them")
    info.add_argument("--ctx", type=int, default=None, help="context to plan for (default: the model's)")
    info.add_argument("--dtype", default="bfloat16", help="activation and unquantized weight dtype for the plan")
    info.add_argument("--kv-policy", choices=["exact", "select"], default=None)

    gen = sub.add_parser("generate", help="generate text (or token ids) from a prompt")
    add_engine_flags(gen)
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
    gen.add_argument("--stats", action="store_true",
                     help="add context used and device/host KV memory to the closing line of figures")
    from lucebox import chat_command, quantize_command
    from lucebox.benchmark import command as bench_command
    from lucebox.server import command as serve_command
    from lucebox.training import distill_command, train_command

    quantize_command.add_parser(sub)
    train_command.add_parser(sub)
    distill_command.add_parser(sub)
    chat_command.add_parser(sub)
    bench_command.add_parser(sub)
    serve_command.add_parser(sub)
    return parser


def _info(args) -> int:
    import torch

    from lucebox.device import resolve_dtype
    from lucebox.info import model_summary
    from lucebox.loading import describe_model

    if args.model is None:
        from lucebox.builtin import builtin_model

        args.model = builtin_model()
    desc = describe_model(args.model)
    cfg = desc.cfg
    int8 = args.kv_dtype == "int8"  # the pool's rows; sliding rings stay in the activations' dtype
    ring_dtype = args.dtype if int8 else args.kv_dtype
    summary = model_summary(cfg, resolve_dtype(ring_dtype, torch.device("cpu")).itemsize, int8)
    plan = _vram_plan(args, desc) if args.vram is not None else None
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


def _vram_plan(args, desc):
    import torch

    from lucebox.arguments import integer
    from lucebox.device import resolve_dtype
    from lucebox.loading import resolve_quantization
    from lucebox.vram_planner import parse_size, plan_for_budget

    cfg, quantization = desc.cfg, resolve_quantization(args.quantization, desc)
    context = integer("max_context", args.ctx, 1, optional=True) or cfg.max_position_embeddings
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    stored = desc.gguf.device_bytes(cfg, dtype) if desc.gguf is not None else None  # a GGUF's own block types
    return plan_for_budget(cfg, parse_size(args.vram), context, dtype, quantization, kv_policy=args.kv_policy,
                           kv_int8=args.kv_dtype == "int8", stored_weights=stored)


def _generate(args) -> int:
    from lucebox.errors import InvalidArgumentError

    prompt = args.prompt
    if args.token_ids is not None:
        try:
            prompt = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
        except ValueError:
            raise InvalidArgumentError("--token-ids must be comma-separated integers, e.g. 1,2,3") from None
    llm = open_engine(args)
    last = None
    for chunk in llm.stream(prompt, max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=[*args.stop, *args.stop_token_id], ignore_eos=args.ignore_eos):
        piece = chunk.text if chunk.text is not None else "".join(f"{t} " for t in chunk.token_ids)
        sys.stdout.write(piece)
        sys.stdout.flush()
        last = chunk
    print(f"\n[{stats_line(last.stats, last.finish_reason, llm, full=args.stats)}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        from lucebox import chat_command, quantize_command
        from lucebox.benchmark import command as bench_command
        from lucebox.server import command as serve_command
        from lucebox.training import distill_command, train_command

        commands = {"info": _info, "generate": _generate, "train": train_command.command,
                    "distill": distill_command.command, "chat": chat_command.command,
                    "bench": bench_command.command, "serve": serve_command.command,
                    "quantize": quantize_command.command}
        return commands[args.command](args)
    except LuceboxError as e:
        print(f"lucebox: error: {in_flag_terms(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lucebox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`lucebox generate ... | head`): stop quietly, like other Unix tools.
        # Python's own flush of stdout at exit would fail again and print a warning: point it at
        # /dev/null first.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (tests capture it)
            pass
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
