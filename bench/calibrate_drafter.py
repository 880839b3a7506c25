"""The calibration file of a drafter that `lucebox distill` made before it wrote one (the built-in
drafter's, `lucebox/data/laguna-code-6m/dflash/lucebox_calibration.json`): greedy and sampled
acceptance by position at a fixed width on held-out code, as distill measures it.

    python bench/calibrate_drafter.py --out /tmp/lucebox_calibration.json   # the built-in drafter
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from lucebox import LLM
    from lucebox.builtin import builtin_model
    from lucebox.output import write_new_file
    from lucebox.speculative.drafters import paired_drafter
    from lucebox.training.corpus import read_texts, stdlib_files
    from lucebox.training.distill_command import held_out_prompts, measure_calibration

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target folder (default: the built-in model)")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the model's paired drafter)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--out", required=True, help="the calibration file to write (a new file)")
    args = p.parse_args()
    model = Path(args.model or builtin_model())
    drafter = Path(args.drafter) if args.drafter else paired_drafter(model)
    tokenizer = LLM(model, draft=None, device="cpu").tokenizer
    prompts = held_out_prompts(tokenizer, read_texts(stdlib_files("held_out")), args.prompts, 64)
    measured, record = measure_calibration(str(model), drafter, prompts, args.tokens)
    write_new_file(args.out, json.dumps(record, indent=1) + "\n")
    for mode, figures in measured.items():
        print(f"{mode}: acceptance length {figures['acceptance_length']}, by position "
              f"{figures['acceptance_by_position']}")


if __name__ == "__main__":
    main()
