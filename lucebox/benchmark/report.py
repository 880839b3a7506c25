"""A benchmark result as a rich table, JSON, CSV and Markdown, and two results side by side.

A result is `{"schema": SCHEMA, "date", "commit", "lucebox", "command", "machine", "model",
"settings", "memory", "rows": [...]}`; each row is flat (`ROW_KEYS`), so the CSV has the same rows.
The figures of a row (speeds are medians over the repeats, with `_min` and `_max` beside them):

- `depth`: prompt tokens. `prefill_tokens_per_s`: depth / prefill time, from an empty cache.
- `decode_tokens_per_s`: (gen - 1) / decode time (the first token comes from the prefill's logits).
- `spec_decode_tokens_per_s`: the same with the drafter. `spec_speedup`: the median over repeats of
  speculative / plain decode speed of two requests run back to back.
- `acceptance_length`: tokens committed per verify round (1.0: no draft kept). `drafts_per_round`:
  drafts verified per round (the adaptive width drafts fewer, or none, when drafting does not pay).
- `kv_device_bytes`: ring caches + device KV pool + chunk summaries, as allocated. `kv_host_bytes`:
  KV offloaded to host memory. `peak_memory_bytes`: as `memory.peak_memory` says (CUDA's allocator
  peak for this row, or the process's peak resident set so far).

Speculative figures are null when no drafter ran.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from lucebox.bounded_json import read_json_file
from lucebox.errors import InvalidArgumentError

SCHEMA = "lucebox-bench/1"
HEADER_KEYS = ("schema", "date", "commit", "lucebox", "command", "machine", "model", "settings", "memory", "rows")
SPEEDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "spec_decode_tokens_per_s")
ROW_KEYS = ("depth", *(f"{s}{end}" for s in SPEEDS for end in ("", "_min", "_max")), "spec_speedup",
            "acceptance_length", "drafts_per_round", "kv_device_bytes", "kv_host_bytes", "peak_memory_bytes")
CSV_KEYS = ("model", "device", *ROW_KEYS)
# Figures that are positive whenever present; the rest (host KV, drafts per round) may be zero.
POSITIVE_KEYS = tuple(k for k in ROW_KEYS if k not in ("kv_host_bytes", "drafts_per_round"))
SPEC_KEYS = tuple(k for k in ROW_KEYS if k.startswith("spec_") or k in ("acceptance_length", "drafts_per_round"))
# A result of the 5-depth ladder is ~10 KiB; 4 MiB holds thousands of rows and keeps a stray file
# (a log, a device) from being read without end.
MAX_RESULT_BYTES = 4 * 2**20


# What the tables, the comparison and the plot read from a result, with the types they need:
# a result file comes from outside, and a wrong type must be refused here, not raise later.
HEADER_TYPES = {"schema": str, "date": str, "commit": str, "lucebox": str, "command": str, "machine": dict,
                "model": dict, "settings": dict, "memory": dict, "rows": list}
PART_TYPES = {
    "model": {"name": str},
    "settings": {"device": str, "dtype": str, "prompt": str, "gen": int, "repeat": int, "drafter": (str, None),
                 "kv_policy": str, "kv_pool_tokens": int},
    "memory": {"peak_memory": str},
    # machine_label reads whichever of these the machine had: each may be absent or null
    "machine": {"gpu": (str, None, "absent"), "cpu": (str, None, "absent"), "processor": (str, None, "absent"),
                "torch_threads": (int, None, "absent")},
}


def _has_type(value: object, allowed: type | tuple) -> bool:
    """`value` is one of `allowed`: types, None (null) or "absent"; a bool is never taken for an int."""
    for kind in allowed if isinstance(allowed, tuple) else (allowed,):
        if kind is None or kind == "absent":
            if value is kind:
                return True
        elif isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool):
            return True
    return False


def _type_name(allowed: type | tuple) -> str:
    kinds = allowed if isinstance(allowed, tuple) else (allowed,)
    names = {str: "a string", int: "an integer", dict: "an object", list: "a list", None: "null", "absent": "absent"}
    return " or ".join(names[k] for k in kinds)


def _header_problems(result: dict) -> list[str]:
    found = []
    for key, allowed in HEADER_TYPES.items():
        if not _has_type(result.get(key, "absent"), allowed):
            found.append(f"missing key '{key}'" if key not in result else f"'{key}' is not {_type_name(allowed)}")
    for part, fields in PART_TYPES.items():
        if not isinstance(result.get(part), dict):
            continue  # already named above
        for field, allowed in fields.items():
            value = result[part].get(field, "absent")
            if not _has_type(value, allowed):
                found.append(f"'{part}.{field}' is {value!r:.40}, not {_type_name(allowed)}")
    return found


def _row_problems(row: object) -> list[str]:
    depth = row.get("depth") if isinstance(row, dict) else None
    if not _has_type(depth, int) or depth <= 0:
        return [f"a row has no positive integer depth: {row!r:.80}"]
    found = []
    for key in ROW_KEYS:
        value = row.get(key, "absent")
        if value is None and key in SPEC_KEYS:
            continue
        if not _has_type(value, (int, float)) or not math.isfinite(value):
            found.append(f"depth {depth}: {key} is {value!r:.40}, not a finite number")
        elif value < 0 or (value == 0 and key in POSITIVE_KEYS):
            found.append(f"depth {depth}: {key} is {value}, not positive")
    return found


def problems(result: object) -> list[str]:
    """What keeps `result` from being a bench result with sane figures (empty when it is one): every field
    the tables, the comparison and the plot read has the type they need."""
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        return [f"no \"schema\": \"{SCHEMA}\""]
    found = _header_problems(result)
    rows = result.get("rows")
    if not isinstance(rows, list) or not rows:
        return found + ["'rows' is not a non-empty list"]
    for row in rows:
        found += _row_problems(row)
    return found


def load_result(path: str | Path, what: str = "--compare") -> dict:
    """A result file (at most MAX_RESULT_BYTES, a regular file), or an InvalidArgumentError naming
    `what` and saying why it is not one."""
    result = read_json_file(path, what, MAX_RESULT_BYTES)
    found = problems(result)
    if found:
        raise InvalidArgumentError(f"{what} {os.fsdecode(path)!r} is not a lucebox bench result: {found[0]}")
    return result


def _rate(row: dict, key: str) -> str:
    value = row[key]
    if value is None:
        return "-"
    text = _number(value)
    low, high = row[f"{key}_min"], row[f"{key}_max"]
    return text if low == high else f"{text} ({_number(low)}-{_number(high)})"


def _number(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def depth_label(value: int) -> str:
    return f"{value // 1024}k" if value % 1024 == 0 else str(value)


def _cells(row: dict) -> list[str]:
    spec = row["spec_speedup"] is not None
    return [depth_label(row["depth"]), _rate(row, "prefill_tokens_per_s"), _rate(row, "decode_tokens_per_s"),
            _rate(row, "spec_decode_tokens_per_s"), f"x{row['spec_speedup']:.2f}" if spec else "-",
            f"{row['acceptance_length']:.2f}" if spec else "-", f"{row['drafts_per_round']:.2f}" if spec else "-",
            _bytes(row["kv_device_bytes"]),
            _bytes(row["kv_host_bytes"]), _bytes(row["peak_memory_bytes"])]


def _columns(result: dict) -> list[str]:
    peak = "peak RSS" if result["memory"]["peak_memory"] == "process_peak_rss" else "peak device"
    return ["depth", "prefill tok/s", "decode tok/s", "spec tok/s", "speedup", "accept len", "drafts/round",
            "KV device", "KV host", peak]


def machine_label(m: dict) -> str:
    """The GPU's name, or the CPU's and the threads torch used."""
    return m.get("gpu") or f"{m.get('cpu') or m.get('processor')}, {m.get('torch_threads')} threads"


def title(result: dict) -> str:
    s = result["settings"]
    return (f"lucebox bench: {result['model']['name']} on {s['device']} ({machine_label(result['machine'])}), "
            f"{s['dtype']}, {s['prompt']}, gen {s['gen']}, median of {s['repeat']} (min-max)")


def table(result: dict) -> Table:
    t = Table(title=escape(title(result)), title_justify="left")  # a name's [...] is text, not markup
    for i, name in enumerate(_columns(result)):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in result["rows"]:
        t.add_row(*_cells(row))
    s = result["settings"]
    drafter = "/".join(Path(s["drafter"]).parts[-2:]) if s["drafter"] else "none"
    t.caption = escape(f"kv policy {s['kv_policy']}, pool {s['kv_pool_tokens']} tokens, drafter {drafter} "
                       f"(adaptive width); commit {result['commit'][:12]}")
    return t


def json_text(result: dict) -> str:
    return json.dumps(result, indent=2) + "\n"


def csv_text(result: dict) -> str:
    out = io.StringIO(newline="")
    writer = csv.DictWriter(out, fieldnames=CSV_KEYS)
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({"model": result["model"]["name"], "device": result["settings"]["device"],
                         **{k: row[k] for k in ROW_KEYS}})
    return out.getvalue()


def markdown_text(result: dict) -> str:
    """A llama-bench style table under one line that names the run."""
    columns = _columns(result)
    lines = [f"{title(result)}; commit `{result['commit'][:12]}`, {result['date']}", "",
             "| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in result["rows"]]
    return "\n".join(lines) + "\n"


RATIOS = (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode"),
          ("spec_decode_tokens_per_s", "spec decode"), ("acceptance_length", "accept len"),
          ("peak_memory_bytes", "peak memory"))


def ratios(a: dict, b: dict) -> list[dict]:
    """B / A for each figure of the depths both results hold (None where either lacks the figure)."""
    by_depth = {row["depth"]: row for row in a["rows"]}
    out = []
    for row in b["rows"]:
        old = by_depth.get(row["depth"])
        if old is not None:
            out.append({"depth": row["depth"], **{key: (row[key] / old[key] if row[key] and old[key] else None)
                                                  for key, _ in RATIOS}})
    return out


def _describe(label: str, result: dict) -> str:
    return escape(f"{label}: {result['model']['name']} on {result['settings']['device']} "
                  f"({machine_label(result['machine'])}), commit {result['commit'][:12]}, {result['date']}")


def _depths_shown(result: dict, most: int = 8) -> str:
    depths = [row["depth"] for row in result["rows"]]
    return str(depths) if len(depths) <= most else f"{str(depths[:most])[:-1]}, ... ({len(depths)} depths)]"


def compare_table(a: dict, b: dict, a_name: str, b_name: str) -> Table:
    rows = ratios(a, b)
    if not rows:
        raise InvalidArgumentError(f"{a_name} and {b_name} share no depth: {_depths_shown(a)} vs {_depths_shown(b)}")
    t = Table(title=f"B / A\n{_describe('A ' + a_name, a)}\n{_describe('B ' + b_name, b)}", title_justify="left")
    t.add_column("depth")
    for _, label in RATIOS:
        t.add_column(label, justify="right")
    for row in rows:
        cells = []
        for key, _ in RATIOS:
            r = row[key]
            better = r is not None and (r < 1 if key == "peak_memory_bytes" else r > 1)
            colour = "" if r is None or abs(r - 1) < 0.02 else ("green" if better else "red")
            cells.append("-" if r is None else f"[{colour}]x{r:.2f}[/{colour}]" if colour else f"x{r:.2f}")
        t.add_row(depth_label(row["depth"]), *cells)
    return t
