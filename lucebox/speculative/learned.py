"""What an engine's requests learn about speculation and hand on to the next: the measured costs
(`RoundCosts`), keep rates (`KeepModel`) and chain-or-tree rates (`ShapeRates`), one of each
for greedy and one for sampled decoding, since sampling keeps fewer drafts, starting from the
drafter's shipped calibration.

The calibration is `lucebox_calibration.json` in the drafter's folder, written by `lucebox
distill` from its held-out measurement: per decoding mode, the keep rate of each draft position
(given the drafts before it were kept) and the drafter's mean confidence there.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from lucebox import bounded_json
from lucebox.errors import DraftModelError
from lucebox.sampling import SamplingParams
from lucebox.speculative.keep_model import KeepModel
from lucebox.speculative.tree_width import ShapeRates
from lucebox.speculative.width import ProbeSchedule, RoundCosts

CALIBRATION_FILE = "lucebox_calibration.json"
MODES = ("greedy", "sampled")
COPY_KEEP_PRIOR = 0.8  # a copy's keep rate per position before any copy was judged


def read_calibration(folder: Path | None) -> dict[str, KeepModel]:
    """The keep models a drafter folder ships (a mode it does not cover starts from defaults)."""
    path = None if folder is None else Path(folder) / CALIBRATION_FILE
    if path is None or not path.is_file():
        return {mode: KeepModel() for mode in MODES}
    try:
        record = bounded_json.loads(bounded_json.read_regular_file(path, "the calibration", 2**20), str(path))
        models = {}
        for mode in MODES:
            figures = record.get(mode)
            models[mode] = KeepModel() if figures is None else KeepModel.from_calibration(
                list(figures["keep_rate_by_position"]), list(figures["confidence_by_position"]))
        return models
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSONInputError among them
        raise DraftModelError(f"{path} is not a drafter calibration lucebox wrote ({e}); delete it or "
                              "run lucebox distill again") from None


def calibration_record(greedy: dict, sampled: dict | None = None) -> dict:
    """The calibration file's content from `Generation.stats`-style figures summed over prompts:
    `acceptance_by_position` (share of rounds reaching and keeping position i) and
    `confidence_by_position`."""
    def mode(stats: dict) -> dict:
        reached = [1.0, *stats["acceptance_by_position"]]
        keep = [round(reached[i + 1] / reached[i], 4) if reached[i] > 0 else 0.0
                for i in range(len(reached) - 1)]
        return {"keep_rate_by_position": keep,
                "confidence_by_position": [round(c, 4) for c in stats["confidence_by_position"]]}
    record = {"greedy": mode(greedy)}
    if sampled is not None:
        record["sampled"] = mode(sampled)
    return record


def copy_keep_model() -> KeepModel:
    """Prompt-lookup copies' keep rates before any copy was judged: text that repeated tends to go on."""
    return KeepModel.from_calibration([COPY_KEEP_PRIOR], [COPY_KEEP_PRIOR])


@dataclass
class Learned:
    costs: RoundCosts
    start: dict[str, KeepModel]  # the shipped calibration, by mode
    keep: dict[str, KeepModel] = field(default_factory=dict)  # running, by mode
    # chain or tree, by mode: sampled rounds keep fewer drafts, so the shape that pays may differ
    shapes: dict[str, ShapeRates] = field(default_factory=lambda: {mode: ShapeRates() for mode in MODES})
    copies: dict[str, KeepModel] = field(default_factory=lambda: {mode: copy_keep_model() for mode in MODES})
    # when the drafter next runs unasked, by mode: a request goes on where the one before left off
    probes: dict[str, ProbeSchedule] = field(default_factory=lambda: {mode: ProbeSchedule() for mode in MODES})

    def __post_init__(self):
        self.keep = self.keep or copy.deepcopy(self.start)

    def keep_for(self, params: SamplingParams, reproducible: bool, copies: bool = False) -> KeepModel:
        """The running model of this mode, the drafter's or prompt-lookup copies'; a reproducible
        (seeded, sampled) request gets a fresh one from the starting figures, so that what earlier
        requests did cannot change its tokens."""
        mode = "greedy" if params.greedy else "sampled"
        if copies:
            return copy_keep_model() if reproducible else self.copies[mode]
        return copy.deepcopy(self.start[mode]) if reproducible else self.keep[mode]
