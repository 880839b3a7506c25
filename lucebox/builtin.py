"""The built-in model: a small Laguna-architecture code model and its DFlash drafter, trained in
this project on the Python standard library (PSF license; `training.corpus.HELD_OUT` never seen)
and shipped inside the package, so lucebox writes real text with no download.

How it was made (commands, seeds, logs): `lucebox/data/README.md`.
"""

from __future__ import annotations

from pathlib import Path

from lucebox.errors import ModelNotFoundError

BUILTIN_NAME = "laguna-code-6m"
BUILTIN_MODEL = Path(__file__).resolve().parent / "data" / BUILTIN_NAME
BUILTIN_DRAFTER = BUILTIN_MODEL / "dflash"  # found by draft="auto", as `<model>/dflash`


def builtin_model() -> Path:
    """The built-in model's folder (a normal Hugging Face folder: `LLM(builtin_model())` loads it)."""
    if not (BUILTIN_MODEL / "config.json").is_file() or not (BUILTIN_MODEL / "model.safetensors").is_file():
        raise ModelNotFoundError(f"the built-in model is missing from this installation ({BUILTIN_MODEL}); "
                                 "reinstall lucebox, or name a model folder")
    return BUILTIN_MODEL
