"""What `draft=` names, as data: read from config.json (or a GGUF file's index) before anything is
loaded (`drafters.resolve_drafter`), costed (`drafters.drafter_cost`), then made into a proposer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lucebox.checkpoints.gguf.file import GGUFFile
from lucebox.checkpoints.loading import ModelDescription
from lucebox.config import ModelConfig
from lucebox.models import dflash


@dataclass(frozen=True)
class DrafterSpec:
    """What `draft=` names, read from config.json before anything is loaded: "ngram", a DFlash
    drafter (`dflash`: its config), a draft model (`model`: its description) or the target's MTP
    head ("mtp": `model` is the target's description, `head` the head's one-layer config), with
    the folder it is read from."""

    kind: str
    folder: Path | None = None
    dflash: dflash.DFlashConfig | None = None
    model: ModelDescription | None = None
    head: ModelConfig | None = None
    head_file: GGUFFile | None = None  # an MTP-only GGUF file the head is read from
    layout: str = "checkpoint"  # an MTP head's tensor names: the checkpoint's (mtp.*), "deepseek" or "speculators"
    quantization: str | None = None  # an MTP head's linear layers, as the target's (`lucebox.kernels.quant`)
