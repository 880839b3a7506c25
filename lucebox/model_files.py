"""The files a model folder names, read as the untrusted input they are: only inside the folder,
and JSON of bounded size. Shared by the checkpoint reader and the tokenizer's files."""

from __future__ import annotations

from pathlib import Path

from lucebox.errors import CheckpointError

# config.json, generation_config.json, a weight index: a few KiB to a few MiB (a big index lists
# ~100k tensor names); anything past this is not one
MODEL_JSON_MAX_BYTES = 64 * 2**20


def inside_folder(folder: Path, name: str, named_by: Path | str) -> Path:
    """`folder / name`, for a file name read from a config (`named_by`), once it is known to stay
    inside the model folder: a relative name without `..`, and, following links, a file inside the
    folder or, when the folder is a Hugging Face cache snapshot (`<repo>/snapshots/<revision>`), a
    blob of that repository (`<repo>/blobs/`), where the cache's links point. The folder itself may
    be a link. Anything else is refused: a model folder is untrusted input."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{named_by} names a file that is not a non-empty string; re-download the model")
    parts = Path(name).parts
    if Path(name).is_absolute() or "\\" in name or ".." in parts:
        raise CheckpointError(f"{named_by} names {name[:200]!r}, which is outside the model folder {folder}; "
                              "lucebox only reads files inside the folder")
    real_folder = Path(folder).resolve()
    target = (real_folder / name).resolve()
    allowed = [real_folder]
    if real_folder.parent.name == "snapshots":
        allowed.append(real_folder.parent.parent / "blobs")
    if not any(target.is_relative_to(root) for root in allowed):
        raise CheckpointError(f"{folder / name} is a link to {target}, outside the model folder {folder}; "
                              "lucebox only reads files inside the folder (or its Hugging Face cache's blobs/)")
    return Path(folder) / name
