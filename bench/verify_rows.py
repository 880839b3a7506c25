"""What one target step costs by its rows on this machine: the price a speculative round pays to
verify each draft row beside the one a plain step decodes (what the width policy's cost line learns).

    python bench/verify_rows.py                       # the built-in model, 1 thread, 1-16 rows
    python bench/verify_rows.py --out bench/results   # replace the committed result

The prompt is the start of a held-out standard-library file (`bench/speculative.py`); each width is
the median of `--reps` steps at the prompt's end through the engine's own runner, each rolled back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.common import write_result  # noqa: E402
from bench.gpu_step_profile import step_seconds  # noqa: E402
from bench.speculative import prompts_from_held_out  # noqa: E402


def main() -> None:
    import torch

    import lucebox

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="1,2,3,4,8,16", help="rows per step, comma-separated (default 1,2,3,4,8,16)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="context before the steps (default 1024)")
    p.add_argument("--reps", type=int, default=30, help="steps timed per width; the median is kept (default 30)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as bench/peers.py)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local; "
                                               "bench/results replaces the committed result)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = lucebox.LLM(device="cpu", dtype="float32")
    name, prompt = prompts_from_held_out(llm.tokenizer, 1, args.prompt_tokens)[0]
    cache = llm.engine.new_cache()
    llm.runner.bind(cache)
    for _ in llm.engine.prefill(prompt, cache):
        pass
    cache.commit(len(prompt))
    widths = [int(w) for w in args.widths.split(",")]
    seconds = {w: step_seconds(llm, cache, w, len(prompt), args.reps) for w in widths}
    rows = [{"rows": w, "ms": round(s * 1e3, 3), "over_one_row": round(s / seconds[widths[0]], 3)}
            for w, s in seconds.items()]
    for row in rows:
        print(f"{row['rows']:3d} rows {row['ms']:7.2f} ms  x{row['over_one_row']:.2f}", flush=True)
    path = write_result("verify_rows", {"model": "built-in", "prompt": name, "context": len(prompt),
                                        "threads": args.threads, "reps": args.reps, "steps": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
