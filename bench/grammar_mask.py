"""The cost of constrained output: the grammar's token mask per generated token on the built-in
model with a nested JSON schema, against the decode step it sits beside (target: under 5%).

Per token the mask is everything `constrained.GrammarState.constrain` does: llguidance computes
the bitmask on the host, one upload, the unpacking and the masked fill of the logits. The step is
`StepRunner.step` (the target forward of one token). Both are timed inside the same constrained
requests (plain decoding, so one step and one mask per token), so they alternate token by token
and share whatever load the machine has; whole requests with and without the schema alternate
too, for the end-to-end figure (a constrained request also commits tokens to the matcher, which
the end-to-end gap includes).

    python bench/grammar_mask.py                       # writes bench/results/local/
    python bench/grammar_mask.py --out bench/results   # replaces the committed result
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import lucebox  # noqa: E402
from bench.common import write_result  # noqa: E402
from lucebox.constrained import GrammarState  # noqa: E402

WORD = {"type": "string", "maxLength": 12}
NESTED = {
    "type": "object", "additionalProperties": False, "required": ["name", "owner", "files"],
    "properties": {
        "name": WORD,
        "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
        "owner": {"type": "object", "additionalProperties": False, "required": ["user", "role"],
                  "properties": {"user": WORD, "role": {"enum": ["admin", "dev", "guest"]},
                                 "id": {"type": "integer", "minimum": 0, "maximum": 100000}}},
        "files": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "additionalProperties": False, "required": ["path", "size"],
            "properties": {"path": WORD, "size": {"type": "integer", "minimum": 0, "maximum": 1 << 20},
                           "binary": {"type": "boolean"}}}},
    },
}
PROMPTS = ["# package metadata\nmeta = ", "config = ", "def describe():\n    return ", "record = "]


def _timing(bucket: list[float], fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        bucket.append(time.perf_counter() - start)
        return out
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="rounds over the prompts (default 3)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default=None, help="folder for the JSON result (default bench/results/local)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the machine is shared: one thread is steadier
    llm = lucebox.LLM()
    steps: list[float] = []
    masks: list[float] = []
    llm.engine.runner.step = _timing(steps, llm.engine.runner.step)
    constrain = GrammarState.constrain
    GrammarState.constrain = lambda self, *a: _timing(masks, constrain)(self, *a)
    llm.generate(PROMPTS[0], max_tokens=8, json_schema=NESTED, speculate=False)  # warm-up
    steps.clear(), masks.clear()
    free_s, constrained_s, tokens, valid = [], [], [], 0
    for seed in range(args.repeat):
        for prompt in PROMPTS:
            options = {"max_tokens": args.max_tokens, "speculate": False, "temperature": 0.8, "seed": seed}
            count = len(steps)
            start = time.perf_counter()
            free = llm.generate(prompt, **options, ignore_eos=True)
            free_s.append((time.perf_counter() - start) / len(free.token_ids))
            del steps[count:]  # only the constrained requests' steps sit beside masks
            start = time.perf_counter()
            out = llm.generate(prompt, **options, json_schema=NESTED)
            constrained_s.append((time.perf_counter() - start) / len(out.token_ids))
            tokens.append(len(out.token_ids))
            valid += out.finish_reason == "stop"
    step_ms, mask_ms = statistics.median(steps) * 1e3, statistics.median(masks) * 1e3
    results = {
        "tokens_per_request": tokens,
        "requests_finished_by_the_grammar": valid,
        "step_ms_median": step_ms,
        "mask_ms_median": mask_ms,
        "mask_ms_p90": statistics.quantiles(masks, n=10)[-1] * 1e3,
        "mask_share_of_step": mask_ms / step_ms,
        "mask_ms_mean": statistics.fmean(masks) * 1e3,
        "step_ms_mean": statistics.fmean(steps) * 1e3,
        "per_token_ms_unconstrained_median": statistics.median(free_s) * 1e3,
        "per_token_ms_constrained_median": statistics.median(constrained_s) * 1e3,
    }
    payload = {"model": "built-in laguna-code-6m, torch backend, 1 thread, plain decoding (speculate=False)",
               "schema": NESTED, "engine": "llguidance", "samples": {"masks": len(masks), "steps": len(steps)},
               "target": "mask under 5% of a decode step", "results": results}
    path = write_result("grammar_mask", payload, args.out)
    for key, value in results.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
