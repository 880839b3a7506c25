"""An MTP head beside the built-in model's DFlash drafter and a DSpark drafter, on held-out Python
code, side by side in one run: every drafter and plain decoding on each prompt in turn.

    python bench/mtp_drafter.py --mtp HEAD_FOLDER --dspark DSPARK_FOLDER [--out bench/results]

HEAD_FOLDER is `lucebox distill --heads mtp`'s output for the built-in model, DSPARK_FOLDER
`lucebox distill --heads dspark`'s. Two rows per drafter, greedy:
  - as users get it (the default engine: adaptive width; DFlash and DSpark also copy repeated text
    by prompt lookup and draft trees where the target allows them), decode tokens/s over plain
    decoding's;
  - the drafter alone at a fixed chain of `--width` drafts (no lookup copies, no trees), its
    acceptance length and acceptance by position: what each drafter predicts, compared evenly.
Every row must reproduce plain decoding token for token (checked here too). Speed-up = decode
tokens/s over plain decoding's, summed over the prompts (each prompt's median run over `--repeats`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402
from bench.speculative import _median_times, prompts_from_held_out  # noqa: E402


def engines_for(model, drafters: dict, width: int, common: dict) -> dict:
    """name -> LLM: plain, then per drafter its default engine and its fixed chain of `width`."""
    import lucebox

    engines = {"plain": lucebox.LLM(model, draft=None, **common)}
    for name, draft in drafters.items():
        engines[name] = lucebox.LLM(model, draft=draft, **common)
        alone = lucebox.LLM(model, draft=draft, adaptive=False, tree_budget=0, draft_k=width, **common)
        if getattr(alone.proposer, "lookup", None) is not None:
            alone.proposer.lookup = None  # the drafter's own drafts only
        engines[f"{name} chain {width}"] = alone
    return engines


def summary(gens: list, plain: list, prompts: int, repeats: int) -> dict:
    from lucebox.training.distill_command import mean_by_position

    decode_s, decoded = _median_times(gens, prompts, repeats)
    rounds = sum(g.stats["rounds"] for g in gens)
    committed = sum(g.stats["acceptance_length"] * g.stats["rounds"] for g in gens)
    return {"decode_tokens_per_s": decoded / decode_s,
            "acceptance_length": committed / rounds if rounds else 0.0,
            "acceptance_by_position": mean_by_position([g.stats["acceptance_by_position"] for g in gens]),
            "drafter": gens[0].stats["drafter"], "rounds": rounds, "decoded_tokens": decoded,
            "identical_to_plain": all(a.token_ids == b.token_ids for a, b in zip(gens, plain, strict=True))}


def main() -> None:
    from lucebox.builtin import builtin_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mtp", required=True, help="an MTP head folder for the model (lucebox distill --heads mtp)")
    p.add_argument("--dspark", default=None, help="a DSpark drafter folder for the model (optional)")
    p.add_argument("--model", default=None, help="target folder (default: the built-in model, with its DFlash drafter)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--width", type=int, default=4, help="drafts per round of the fixed chains")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()

    model = args.model or builtin_model()
    drafters = {"dflash": "auto", **({"dspark": args.dspark} if args.dspark else {}), "mtp": args.mtp}
    engines = engines_for(model, drafters, args.width, {"device": "cpu", "dtype": "float32"})
    prompts = prompts_from_held_out(engines["plain"].tokenizer, args.prompts, args.prompt_tokens)
    for engine in engines.values():  # warm-up: first-call costs stay out of the figures
        engine.generate(prompts[0][1][:16], max_tokens=8, ignore_eos=True)
    runs = {name: [] for name in engines}
    for _, prompt in prompts:
        for _ in range(args.repeats):
            for name, engine in engines.items():  # side by side: every configuration on this prompt in turn
                runs[name].append(engine.generate(prompt, max_tokens=args.tokens, ignore_eos=True))
    rows = {name: summary(gens, runs["plain"], len(prompts), args.repeats) for name, gens in runs.items()}
    for name, row in rows.items():
        row["speedup_vs_plain"] = row["decode_tokens_per_s"] / rows["plain"]["decode_tokens_per_s"]
        print(f"{name:18s} decode {row['decode_tokens_per_s']:7.1f} tok/s  x{row['speedup_vs_plain']:.2f}  "
              f"acceptance length {row['acceptance_length']:.2f}", flush=True)
    chain = f" chain {args.width}"
    verdict = {"mtp_over_dflash_speed": rows["mtp"]["speedup_vs_plain"] / rows["dflash"]["speedup_vs_plain"],
               "mtp_over_dflash_acceptance": rows["mtp" + chain]["acceptance_length"]
               / rows["dflash" + chain]["acceptance_length"]}
    path = write_result("mtp_drafter", {
        "model": str(model), "drafters": drafters, "prompts": [name for name, _ in prompts],
        "prompt_tokens": args.prompt_tokens, "generated_tokens": args.tokens, "width": args.width,
        "repeats": args.repeats, "results": rows, **{k: round(v, 3) for k, v in verdict.items()},
    }, args.out)
    print(f"wrote {path}; the MTP head over DFlash: speed x{verdict['mtp_over_dflash_speed']:.2f}, fixed-chain "
          f"acceptance x{verdict['mtp_over_dflash_acceptance']:.2f}")
    if not all(row["identical_to_plain"] for row in rows.values()):
        sys.exit("speculative output differed from plain decoding")


if __name__ == "__main__":
    main()
