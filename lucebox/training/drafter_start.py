"""What `lucebox distill` starts from: the drafter's config.json (z-lab layout for `--heads dflash`,
Speculators' `dspark` layout for `--heads dspark`), and with `--init` an existing DFlash or DSpark
drafter's backbone (its shape, target layers, block size and mask token, and its weights), and with
`--heads dspark` a DSpark drafter's own heads too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.config import ModelConfig
from lucebox.errors import DraftModelError
from lucebox.models import dflash
from lucebox.models.dspark import DSparkConfig, head_shapes, head_sources, heads_config
from lucebox.models.hf_config import architecture_name
from lucebox.models.sources import Unloaded
from lucebox.models.speculators_layout import from_speculators, is_speculators, to_speculators

# --heads: the plain DFlash drafter, DFlash + DSpark's two heads, or an MTP head (`training.mtp_head`)
HEADS = ("dflash", "dspark", "mtp")
# checkpoint names under which a DSpark drafter stores its heads (`models.dspark.head_sources`)
HEAD_PREFIXES = tuple(sorted({name.split(".")[0] + "." for name in
                              head_sources(DSparkConfig(1, True, True)).values()}))


def _drafter_config(folder: str | Path) -> dict:
    """The z-lab-layout config of the drafter in `folder` (any layout), with its DSpark heads'
    `dspark_config` if it has them."""
    hf = read_json(locate_config(folder))
    if is_speculators(hf):
        hf = from_speculators(hf)
    if architecture_name(hf) not in dflash.ARCHITECTURES:
        raise DraftModelError(f"--init {folder}: not a DFlash drafter (its config.json names "
                              f"{architecture_name(hf)!r})")
    return hf


def init_config(folder: str | Path, target: ModelConfig) -> dict:
    """The z-lab-layout config of the drafter in `folder` (any layout, its DSpark heads' keys kept),
    checked against the target."""
    from lucebox.speculative.drafters import _check_dflash  # the check `LLM(draft=...)` makes

    hf = _drafter_config(folder)
    _check_dflash(dflash.build_config(hf), target, Path(folder))
    return hf


def load_start(folder: str | Path, with_heads: bool) -> dict[str, torch.Tensor]:
    """The weights (float32, CPU) training starts from: the backbone of the DFlash drafter in
    `folder`, and its DSpark heads too if it has them and `with_heads` (else they are left unread)."""
    hf = _drafter_config(folder)
    if not with_heads:
        hf.pop("dspark_config", None)
    cfg = dflash.build_config(hf)
    skipped = tuple(Unloaded(prefix, "--heads dflash writes a plain DFlash drafter") for prefix in HEAD_PREFIXES)
    return load_weights(CheckpointIndex(weight_files(Path(folder))), dflash.sources(cfg), dflash.weight_shapes(cfg),
                        torch.float32, torch.device("cpu"), skipped)


def distill_layout(heads: str, markov_rank: int, init: str | None, target_path: str, target_hf: dict,
                   target: ModelConfig, fresh: Callable[[], dict]) -> dict:
    """config.json of the drafter distill writes: the `--init` drafter's backbone or `fresh()`'s
    (a z-lab config), in the layout `heads` asks for. With `--heads dspark`, a DSpark `--init`
    drafter's own heads (their rank and kind) are kept, to go on training; other drafters get new
    heads of rank `markov_rank`."""
    zlab = init_config(init, target) if init else fresh()
    own_heads = zlab.pop("dspark_config", None)
    if heads == "dflash":
        return zlab
    verifier = {"name_or_path": str(target_path), "architectures": list(target_hf.get("architectures") or [])}
    wanted = heads_config(own_heads) if own_heads else DSparkConfig(markov_rank, True, True)
    return to_speculators(zlab, dflash.build_config(zlab), wanted, verifier)


def head_names(cfg: dflash.DFlashConfig) -> set[str]:
    """The weights of the DSpark heads (what `--freeze-backbone` trains)."""
    return set(head_shapes(cfg.heads, 1, 1)) if cfg.heads else set()
