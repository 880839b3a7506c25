"""What every benchmark records next to its numbers: the machine, the commit, the command (the machine
and the commit come from `lucebox.benchmark.record`, which `lucebox bench` uses too)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lucebox.benchmark.record import commit, machine, utc_now

RESULTS = Path(__file__).resolve().parent / "results"


def write_result(name: str, payload: dict, directory: Path | str | None = None) -> Path:
    """Write the record under `directory`; by default under bench/results/local/ (not committed), so a
    run never replaces the committed results unless asked to with --out bench/results."""
    directory = Path(directory) if directory else RESULTS / "local"
    directory.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": utc_now(), "commit": commit(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), **payload}
    path = directory / f"{name}-{record['machine'].get('gpu', 'cpu').replace(' ', '_')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
