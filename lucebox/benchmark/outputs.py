"""The files `lucebox bench` writes: --json, --csv, --md and --plot.

Each is checked before anything is measured, so a run of hours never ends in a refusal: not a
folder, not a file the user already has (unless --overwrite), not named twice, in a folder that
exists and takes a new file. Each is written at the end through a temporary sibling renamed into
place (`lucebox.output`), so a write cut short leaves the old file whole. A write that fails anyway
(a full disk) loses no figures: the table is already on the screen, and the error names the files
that were not written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from lucebox.benchmark import report
from lucebox.errors import InvalidArgumentError, LuceboxError
from lucebox.output import output_path, write_new_file

FLAGS = ("json", "csv", "md", "plot")  # in the order they are written: text first, the plot (slowest) last


class OutputsNotWrittenError(LuceboxError):
    """Some output files could not be written after the run; the message names them."""


def planned_outputs(args, reads: tuple[str | os.PathLike, ...] = ()) -> dict[str, Path]:
    """Flag -> the file it names, for each output flag given, each checked as the module docstring says.
    `reads`: files the run reads (the prompt file), which no output may replace."""
    planned: dict[str, Path] = {}
    for flag in FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            planned[flag] = _checked_target(f"--{flag}", value, args.overwrite)
    _refuse_shared(planned, reads)
    return planned


def _checked_target(flag: str, value: str, overwrite: bool) -> Path:
    try:
        path = output_path(value, "file")  # the path write_new_file writes, so the check is of that file
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{flag}: {e}") from None
    try:
        _check_target(flag, value, path, overwrite)
    except OSError as e:  # a name too long, a folder on the way that cannot be searched
        raise InvalidArgumentError(f"{flag} {value!r}: {e.strerror or e}") from None
    return path


def _check_target(flag: str, value: str, path: Path, overwrite: bool) -> None:
    # "r.json/" names a folder even where none exists (Path drops the slash): written, it would fail
    if path.is_dir() or os.fsdecode(value).endswith(("/", os.sep)) or path.name in ("", ".", ".."):
        raise InvalidArgumentError(f"{flag} {value!r} is a folder; give a file name")
    if path.is_symlink() or (path.exists() and not stat.S_ISREG(path.lstat().st_mode)):
        # /dev/stdout (a link), a FIFO, a device: renaming a file over it would replace the node itself
        raise InvalidArgumentError(f"{flag} {value!r} exists and is not a regular file; give a new file name")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise InvalidArgumentError(f"{flag} {value!r} already exists; choose a new file or pass --overwrite to "
                                   "replace it")
    _probe_folder(flag, value, path.parent)


def _probe_folder(flag: str, value: str, folder: Path) -> None:
    """Create and remove a file in `folder`: the only test that also holds for root (os.access says yes
    to root everywhere) and for a read-only file system."""
    if not folder.is_dir():
        missing = "is not a folder" if folder.exists() else "does not exist"
        raise InvalidArgumentError(f"{flag} {value!r}: the folder {str(folder)!r} {missing}")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".lucebox-bench-", suffix=".probe"):
            pass
    except OSError as e:
        raise InvalidArgumentError(f"{flag} {value!r}: cannot write in {str(folder)!r} "
                                   f"({e.strerror or e})") from None


def _refuse_shared(planned: dict[str, Path], reads: tuple[str | os.PathLike, ...]) -> None:
    """Two flags naming one file would leave only the last written; an output over an input would
    replace what the run reads."""
    seen: dict[Path, str] = {Path(os.path.abspath(Path(r).expanduser())): "the file the run reads" for r in reads}
    for flag, path in planned.items():
        key = Path(os.path.abspath(path))
        if key in seen:
            raise InvalidArgumentError(f"--{flag} {str(path)!r} is also {seen[key]}; give each output its own file")
        seen[key] = f"--{flag}'s file"


def write_outputs(result: dict, planned: dict[str, Path], overwrite: bool) -> list[Path]:
    """Write each planned file; the ones written. Every file is tried; if any fails, an
    OutputsNotWrittenError names those (the others are written)."""
    written, failed = [], []
    for flag, path in planned.items():
        try:
            write_new_file(path, RENDERERS[flag](result), overwrite=overwrite)
            written.append(path)
        except LuceboxError as e:
            failed.append(f"--{flag} ({e})")
    if failed:
        shown = f"; wrote {', '.join(map(str, written))}" if written else ""
        raise OutputsNotWrittenError(f"not written: {'; '.join(failed)}{shown}; the figures are in the table above")
    return written


def _png(result: dict) -> bytes:
    from lucebox.benchmark.plot import png_bytes  # matplotlib: imported only when a plot is asked for

    return png_bytes(result)


RENDERERS: dict[str, Callable[[dict], str | bytes]] = {
    "json": report.json_text, "csv": report.csv_text, "md": report.markdown_text, "plot": _png}
