"""The built-in model: a small Laguna-architecture code model and its DFlash drafter, trained in
this project on the Python standard library (PSF license; `training.corpus.HELD_OUT` never seen)
and shipped inside the package, so lucebox writes real text with no download.

Every command and `LLM` take it by its name, `laguna-code-6m` (or no MODEL at all). How it was made
(commands, seeds, logs): `lucebox/data/README.md`.
"""

from __future__ import annotations

from pathlib import Path

from lucebox.errors import ModelNotFoundError

BUILTIN_NAME = "laguna-code-6m"
BUILTIN_MODEL = Path(__file__).resolve().parent / "data" / BUILTIN_NAME
BUILTIN_DRAFTER = BUILTIN_MODEL / "dflash"  # found by draft="auto", as `<model>/dflash`


def model_path(model: str | Path | None) -> str | Path:
    """What a MODEL argument names: the built-in model for None or its name (`laguna-code-6m`, when
    no file or folder of that name exists here), else the path as given."""
    if model is None or (str(model) == BUILTIN_NAME and not Path(model).exists()):
        return builtin_model()
    return model


def builtin_model() -> Path:
    """The built-in model's folder (a normal Hugging Face folder: `LLM(builtin_model())` loads it)."""
    if not (BUILTIN_MODEL / "config.json").is_file() or not (BUILTIN_MODEL / "model.safetensors").is_file():
        raise ModelNotFoundError(f"the built-in model is missing from this installation ({BUILTIN_MODEL}); "
                                 "reinstall lucebox, or name a model folder")
    return BUILTIN_MODEL
