"""The rule every fuzz test holds mutated model files to: each case loads and runs, or raises a
LuceboxError; any other exception, a case slower than SLOW_S, one whose Python objects peak above
MEMORY_LIMIT (tracemalloc: what a parser builds from declared counts and lengths), or a hang is
a failure."""

from __future__ import annotations

import faulthandler
import json
import time
import tracemalloc
from collections.abc import Callable, Iterator

from lucebox.errors import LuceboxError

SLOW_S = 5.0
MEMORY_LIMIT = 256 * 2**20  # a tiny model's case needs a few MB; a parser misled by a count needs gigabytes


def run_cases(cases: Iterator[tuple[str, bytes]], exercise: Callable[[], None], max_cases: int,
              budget_s: float) -> tuple[int, dict[str, int], list[str]]:
    """Exercise each case `cases` yields (it has written its mutation, named by a label and the
    mutated bytes, before yielding): (cases tried, outcome counts, failures)."""
    failures: list[str] = []
    outcomes: dict[str, int] = {}
    tried = 0
    start = time.perf_counter()
    tracemalloc.start()
    try:
        for label, mutated in cases:
            if tried >= max_cases or time.perf_counter() - start >= budget_s:
                break
            tried += 1
            outcome = _one_case(exercise, f"{label} <- {mutated[:300]!r}", failures)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        tracemalloc.stop()
    return tried, outcomes, failures


def _one_case(exercise: Callable[[], None], sample: str, failures: list[str]) -> str:
    faulthandler.dump_traceback_later(30, exit=True)  # a hang kills the run loudly
    held_before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    case_start = time.perf_counter()
    try:
        exercise()
        outcome = "ok"
    except LuceboxError as e:
        outcome = type(e).__name__
    except Exception as e:  # noqa: BLE001 - any other exception is what the fuzz tests look for
        outcome = "untyped"
        failures.append(f"{type(e).__name__}: {str(e)[:200]} in {sample}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    seconds = time.perf_counter() - case_start
    peak = tracemalloc.get_traced_memory()[1] - held_before
    if seconds > SLOW_S:
        failures.append(f"took {seconds:.1f} s: {sample}")
    if peak > MEMORY_LIMIT:
        failures.append(f"Python objects peaked at {peak / 2**20:.0f} MB: {sample}")
    return outcome


def hostile_json(rng) -> str:
    """JSON text (or what passes for it) of one value made to break a reader rather than a parser's
    grammar: nesting past any recursion limit, numbers past what Python converts or float64 holds,
    the constants JSON has not. Spliced into a valid document in place of one of its values."""
    depth = rng.choice([101, 1_000, 100_000])
    return rng.choice([
        "[" * depth + "]" * depth,
        '{"a": ' * depth + "1" + "}" * depth,
        "[" * depth,  # never closed
        "1" * rng.choice([101, 4_301, 5_000]),
        "-0." + "0" * 5_000 + "1",
        "1e999", "-1e400", "NaN", "Infinity", "-Infinity",
    ])


def splice_hostile(rng, value, hostile: str) -> str:
    """The JSON text of `value` with one of its values (at any depth, the whole value included)
    replaced by the text `hostile`."""
    slots = []

    def walk(node, path):
        slots.append(path)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            walk(child, (*path, key))

    walk(value, ())
    path = rng.choice(slots)
    marker = "\x00HOSTILE\x00"
    if not path:
        return hostile
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    old, parent[path[-1]] = parent[path[-1]], marker
    try:
        return json.dumps(value).replace(json.dumps(marker), hostile)
    finally:
        parent[path[-1]] = old
