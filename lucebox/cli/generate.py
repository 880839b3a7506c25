"""`lucebox generate [MODEL] --prompt TEXT`: one request, streamed to stdout, its figures on stderr."""

from __future__ import annotations

import sys

from lucebox.cli.stats_line import stats_line
from lucebox.engine_flags import add_engine_flags, open_engine


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text (or token ids) from a prompt")
    add_engine_flags(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--token-ids", help="prompt as comma-separated token ids (for models without a tokenizer)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=0.0,
                   help="temperature; 0 is greedy (default: 0, greedy, for output that repeats run to run; chat and "
                        "serve default to the model's generation_config.json)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 turns it off")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this probability")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the most likely one")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL-style penalty of tokens seen; 1 is off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh one from the OS)")
    p.add_argument("--stop", action="append", default=[], help="stop string, never printed (repeatable); "
                   "for a newline use the shell's quoting, e.g. $'\\n\\n'")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--stats", action="store_true",
                   help="add context used and device/host KV memory to the closing line of figures")


def command(args) -> int:
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


