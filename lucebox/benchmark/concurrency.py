"""Many clients on one engine: aggregate and per-request tokens/s and time to first token, at each
number of clients at once (`lucebox bench --concurrency 1,2,4,8`; `bench/concurrency.py`).

Each client is a thread streaming one request at a time from the same `LLM` (opened with
`parallel` at least the most clients), all starting together; a round is every client's one
request, and the figures are the round's: generated tokens over the round's wall time
(aggregate), each request's decode tokens/s after its first token, each request's time to first
token. Rounds of every setting are interleaved (`rounds`), so a drift of the machine's speed
spreads over all of them instead of favouring one.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

# Distinct openings: each client's own conversation, as an editor's and an agent's requests are.
PROMPTS = ["def parse_header(line):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import json\n\n\ndef load(path):\n", "def merge_sorted(a, b):\n",
           "def retry(func, attempts=3):\n", "class Matrix:\n    def __mul__(self, other):\n",
           "def flatten(items):\n", "async def fetch_all(urls):\n"]


def one_round(llm, clients: int, max_tokens: int, speculate: bool, prompts: list = PROMPTS) -> list[dict]:
    """`clients` requests at once, each from its own thread: per request, its time to first token,
    its decode tokens/s and its tokens, plus the round's wall time."""
    results: list[dict | None] = [None] * clients
    errors: list[BaseException] = []
    go = threading.Barrier(clients)

    def client(i: int) -> None:
        try:
            go.wait()
            start, first, tokens = time.perf_counter(), None, 0
            for chunk in llm.stream(prompts[i % len(prompts)], max_tokens=max_tokens, ignore_eos=True,
                                    speculate=speculate):
                tokens += len(chunk.token_ids)
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
            end = time.perf_counter()
            results[i] = {"start": start, "end": end, "ttft_s": first - start, "tokens": tokens,
                          "decode_tokens_per_s": (tokens - 1) / (end - first) if tokens > 1 else None}
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,), name=f"bench-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def summary(rounds: list[list[dict]]) -> dict:
    """The figures of several rounds of one setting: medians over rounds of the aggregate tokens/s,
    over requests of the decode tokens/s, and time to first token p50 and p95 over all requests."""
    aggregate = [sum(r["tokens"] for r in rnd) / (max(r["end"] for r in rnd) - min(r["start"] for r in rnd))
                 for rnd in rounds]
    requests = [r for rnd in rounds for r in rnd]
    ttft = sorted(r["ttft_s"] for r in requests)
    decode = [r["decode_tokens_per_s"] for r in requests if r["decode_tokens_per_s"] is not None]
    return {"aggregate_tokens_per_s": statistics.median(aggregate), "aggregate_tokens_per_s_all": aggregate,
            "request_decode_tokens_per_s": statistics.median(decode) if decode else None,
            "ttft_p50_s": _quantile(ttft, 0.5), "ttft_p95_s": _quantile(ttft, 0.95), "requests": len(requests)}


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted `values`, interpolated between the two nearest."""
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def measure(llm, concurrency: list[int], max_tokens: int, rounds: int, speculation: list[bool],
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every (speculation, clients) setting's `summary`, its rounds interleaved with the others'."""
    settings = [(spec, clients) for spec in speculation for clients in concurrency]
    collected: dict[tuple[bool, int], list] = {s: [] for s in settings}
    one_round(llm, max(concurrency), 4, True)  # warm: every slot's cache made, drafters forked
    for r in range(rounds):
        for spec, clients in settings:
            if progress is not None:
                progress(f"round {r + 1}/{rounds}: {clients} client(s), speculation {'on' if spec else 'off'}")
            collected[(spec, clients)].append(one_round(llm, clients, max_tokens, spec))
    return [{"speculation": spec, "clients": clients, **summary(collected[(spec, clients)])}
            for spec, clients in settings]
