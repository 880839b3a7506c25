"""What `lucebox distill` starts from: the drafter's config.json (z-lab layout for `--heads dflash`,
Speculators' `dspark` layout for `--heads dspark`), and with `--init` an existing DFlash drafter's
backbone (its shape, target layers, block size and mask token, and its weights)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.config import ModelConfig
from lucebox.errors import DraftModelError
from lucebox.models import dflash
from lucebox.models.dspark import DSparkConfig, head_shapes
from lucebox.models.hf_config import architecture_name
from lucebox.models.speculators_layout import from_speculators, is_speculators, to_speculators

HEADS = ("dflash", "dspark")  # --heads: the plain DFlash drafter, or DFlash + DSpark's two heads


def _backbone_config(folder: str | Path) -> dict:
    hf = read_json(locate_config(folder))
    if is_speculators(hf):
        hf = from_speculators(hf)
        hf.pop("dspark_config", None)
    if architecture_name(hf) not in dflash.ARCHITECTURES:
        raise DraftModelError(f"--init {folder}: not a DFlash drafter (its config.json names "
                              f"{architecture_name(hf)!r})")
    return hf


def init_config(folder: str | Path, target: ModelConfig) -> dict:
    """The z-lab-layout config of the drafter in `folder` (any layout; DSpark heads left out: distill
    trains them afresh), checked against the target."""
    from lucebox.speculative.drafters import _check_dflash  # the check `LLM(draft=...)` makes

    hf = _backbone_config(folder)
    _check_dflash(dflash.build_config(hf), target, Path(folder))
    return hf


def load_backbone(folder: str | Path) -> dict[str, torch.Tensor]:
    """The backbone weights (float32, CPU) of the DFlash drafter in `folder`."""
    cfg = dflash.build_config(_backbone_config(folder))
    return load_weights(CheckpointIndex(weight_files(Path(folder))), dflash.sources(cfg), dflash.weight_shapes(cfg),
                        torch.float32, torch.device("cpu"))


def distill_layout(heads: str, markov_rank: int, init: str | None, target_path: str, target_hf: dict,
                   target: ModelConfig, fresh: Callable[[], dict]) -> dict:
    """config.json of the drafter distill writes: the `--init` drafter's backbone or `fresh()`'s
    (a z-lab config), in the layout `heads` asks for."""
    zlab = init_config(init, target) if init else fresh()
    if heads == "dflash":
        return zlab
    verifier = {"name_or_path": str(target_path), "architectures": list(target_hf.get("architectures") or [])}
    return to_speculators(zlab, dflash.build_config(zlab), DSparkConfig(markov_rank, True, True), verifier)


def head_names(cfg: dflash.DFlashConfig) -> set[str]:
    """The weights of the DSpark heads (what `--freeze-backbone` trains)."""
    return set(head_shapes(cfg.heads, 1, 1)) if cfg.heads else set()
