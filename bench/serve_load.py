"""Load test of `lucebox serve` on localhost: concurrent streaming clients, bounded in requests and
time. Reports requests/s, time to first token and decode tokens/s per request.

    python bench/serve_load.py                        # built-in model, 4 clients x 8 requests, 64 tokens each
    python bench/serve_load.py MODEL --clients 8 --requests 64 --max-tokens 128 --out bench/results

One engine serves one request at a time (the others queue), so time to first token grows with the
number of clients while tokens/s per request stays that of one stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402
from lucebox.server.process import ServerProcess  # noqa: E402

PROMPTS = ["def parse_header(line):\n", "class LRUCache:\n", "import json\n\n\ndef load(path):\n",
           "def merge_sorted(a, b):\n", "def retry(func, attempts=3):\n", "class Matrix:\n"]


def _client_loop(client, model, jobs: list[int], max_tokens: int, deadline: float, out: list[dict]) -> None:
    for j in jobs:
        if time.perf_counter() > deadline:
            return
        start = time.perf_counter()
        first = None
        tokens = 0
        stream = client.completions.create(model=model, prompt=PROMPTS[j % len(PROMPTS)], max_tokens=max_tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        for event in stream:
            if event.choices and event.choices[0].text and first is None:
                first = time.perf_counter()
            if event.usage is not None:
                tokens = event.usage.completion_tokens
        end = time.perf_counter()
        out.append({"ttft_s": (first or end) - start, "total_s": end - start, "completion_tokens": tokens,
                    "decode_tokens_per_s": (tokens - 1) / (end - first) if first and tokens > 1 and end > first
                    else None})


def _summary(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}
    return {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
            "min": values[0], "max": values[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=32, help="requests in all, spread over the clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=300, help="no new request starts after this many seconds")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    server = ServerProcess(*([args.model] if args.model else []), "--max-queue", str(args.clients + 1),
                           api_key="sk-load")
    try:
        import openai

        model = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-load").models.list().data[0].id
        results: list[dict] = []
        deadline = time.perf_counter() + args.time_limit
        clients = [threading.Thread(target=_client_loop, args=(
            openai.OpenAI(base_url=server.url + "/v1", api_key="sk-load", max_retries=0), model,
            list(range(c, args.requests, args.clients)), args.max_tokens, deadline, results))
            for c in range(args.clients)]
        start = time.perf_counter()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.perf_counter() - start
        cancelled = server.metric("requests_cancelled_total")
    finally:
        exit_code = server.stop()
    summary = {
        "requests_done": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
        "generated_tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "ttft_s": _summary([r["ttft_s"] for r in results]),
        "request_decode_tokens_per_s": _summary([r["decode_tokens_per_s"] for r in results]),
        "requests_cancelled": cancelled, "server_exit_code": exit_code,
    }
    path = write_result("serve_load", {"model": args.model or "laguna-code-6m (built-in)", "clients": args.clients,
                                       "requests": args.requests, "max_tokens": args.max_tokens,
                                       "summary": summary, "requests_detail": results}, args.out)
    print(f"{len(results)} requests in {wall:.1f} s: {summary['requests_per_s']:.2f} requests/s, "
          f"{summary['generated_tokens_per_s']:.1f} generated tokens/s; time to first token median "
          f"{summary['ttft_s']['median']:.3f} s (p90 {summary['ttft_s']['p90']:.3f}); per-request decode median "
          f"{summary['request_decode_tokens_per_s']['median']:.1f} tok/s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
