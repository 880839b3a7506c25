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
import json
import math
from pathlib import Path

from rich.table import Table

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


def problems(result: object) -> list[str]:
    """What keeps `result` from being a bench result with sane figures (empty when it is one)."""
    if not isinstance(result, dict) or result.get("schema") != SCHEMA:
        return [f"no \"schema\": \"{SCHEMA}\""]
    found = [f"missing key '{k}'" for k in HEADER_KEYS if k not in result]
    rows = result.get("rows")
    if not isinstance(rows, list) or not rows:
        return found + ["'rows' is not a non-empty list"]
    for row in rows:
        depth = row.get("depth") if isinstance(row, dict) else None
        if not isinstance(depth, int) or depth <= 0:
            found.append(f"a row has no positive integer depth: {row!r:.80}")
            continue
        for key in ROW_KEYS:
            value = row.get(key, "absent")
            if value is None and key in SPEC_KEYS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                found.append(f"depth {depth}: {key} is {value!r}, not a finite number")
            elif value < 0 or (value == 0 and key in POSITIVE_KEYS):
                found.append(f"depth {depth}: {key} is {value}, not positive")
    return found


def load_result(path: str | Path) -> dict:
    """A result file, or InvalidArgumentError saying why it is not one."""
    try:
        result = json.loads(Path(path).read_text())
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise InvalidArgumentError(f"{path} is not JSON ({e})") from None
    found = problems(result)
    if found:
        raise InvalidArgumentError(f"{path} is not a lucebox bench result: {found[0]}")
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
    t = Table(title=title(result), title_justify="left")
    for i, name in enumerate(_columns(result)):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in result["rows"]:
        t.add_row(*_cells(row))
    s = result["settings"]
    drafter = "/".join(Path(s["drafter"]).parts[-2:]) if s["drafter"] else "none"
    t.caption = (f"kv policy {s['kv_policy']}, pool {s['kv_pool_tokens']} tokens, drafter {drafter} (adaptive width); "
                 f"commit {result['commit'][:12]}")
    return t


def write_json(result: dict, path: str | Path) -> None:
    _parent(path).write_text(json.dumps(result, indent=2) + "\n")


def write_csv(result: dict, path: str | Path) -> None:
    with _parent(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS)
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow({"model": result["model"]["name"], "device": result["settings"]["device"],
                             **{k: row[k] for k in ROW_KEYS}})


def write_markdown(result: dict, path: str | Path) -> None:
    """A llama-bench style table under one line that names the run."""
    columns = _columns(result)
    lines = [f"{title(result)}; commit `{result['commit'][:12]}`, {result['date']}", "",
             "| " + " | ".join(columns) + " |", "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in result["rows"]]
    _parent(path).write_text("\n".join(lines) + "\n")


def _parent(path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


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
    return (f"{label}: {result['model']['name']} on {result['settings']['device']} "
            f"({machine_label(result['machine'])}), commit {result['commit'][:12]}, {result['date']}")


def compare_table(a: dict, b: dict, a_name: str, b_name: str) -> Table:
    rows = ratios(a, b)
    if not rows:
        raise InvalidArgumentError(f"{a_name} and {b_name} share no depth: "
                                   f"{[r['depth'] for r in a['rows']]} vs {[r['depth'] for r in b['rows']]}")
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
