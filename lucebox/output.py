"""What a command writes: a folder or a file it creates, never one the user already has.

Every command that writes (`train`, `distill`, `quantize`, the chat's `/save`) goes through here:
- an existing target is refused unless the user said `--overwrite` (never silently);
- the new content is written to a sibling first (`OUT.partial` for a folder, a hidden temporary
  file for a file) and renamed over the target only once complete, so a run cut short at any
  point leaves the old target as it was;
- a `.partial` folder is reused (to resume) or removed only if lucebox made it: it holds a marker
  file; a folder of that name without the marker is the user's and is refused.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lucebox.arguments import path as path_argument
from lucebox.errors import InvalidArgumentError

PARTIAL_SUFFIX = ".partial"
PARTIAL_MARKER = ".lucebox-partial"  # names the command that made a partial folder


class OutputExistsError(InvalidArgumentError):
    """The folder or file a command would write already exists (pass --overwrite to replace it)."""


def _refuse_existing(target: Path, what: str, overwrite: bool) -> None:
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        return  # an empty folder holds nothing to lose
    if not overwrite:
        raise OutputExistsError(f"{target} already exists; choose a new {what} or pass --overwrite to replace it")
    if what == "folder" and (target.is_symlink() or not target.is_dir()):
        raise OutputExistsError(f"{target} exists and is not a folder; --overwrite replaces folders only")
    if what == "file" and target.is_dir():
        raise OutputExistsError(f"{target} is a folder; give a file name")


def _holds(out: Path, source: Path) -> bool:
    """Would replacing `out` remove `source`?"""
    out, source = out.resolve(), source.resolve()
    return out == source or out in source.parents


def partial_folder(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def _open_partial(partial: Path, command: str, resume: bool) -> bool:
    """Make `partial`, or keep it (to resume) if lucebox made it; True if it was kept."""
    if partial.exists() or partial.is_symlink():
        if partial.is_symlink() or not (partial / PARTIAL_MARKER).is_file():
            raise OutputExistsError(f"{partial} exists and was not made by lucebox; move it away first (lucebox "
                                    "writes there before renaming to the folder asked for)")
        if resume:
            return True
        shutil.rmtree(partial)
    try:
        partial.mkdir(parents=True)
        (partial / PARTIAL_MARKER).write_text(command + "\n")
    except OSError as e:
        raise InvalidArgumentError(f"cannot create {partial}: {e.strerror or e}") from None
    return False


def _replace(partial: Path, out: Path) -> None:
    """Rename the finished `partial` to `out`; an existing `out` is moved aside first and removed last."""
    (partial / PARTIAL_MARKER).unlink()
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        partial.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    old.rmdir()
    out.rename(old)
    partial.rename(out)
    shutil.rmtree(old)


@contextlib.contextmanager
def new_folder(out: str | Path, command: str, *, overwrite: bool = False, resume: bool = False,
               continue_out: bool = False, reads: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yield the folder to write `out` into (`OUT.partial`); on a clean exit it becomes `out`.

    `resume`: keep what an earlier interrupted run of this command left in `OUT.partial`.
    `continue_out`: the user asked to go on from a finished `out` (e.g. `--resume`): a fresh
    partial folder starts as a copy of it, and `out` is replaced at the end.
    `reads`: files and folders the command reads from; `out` may not be or hold any of them."""
    out = Path(path_argument("the output folder", out)).expanduser()
    for source in reads:
        if _holds(out, Path(source).expanduser()):
            raise InvalidArgumentError(f"{out} holds {source}, which this command reads; choose another folder")
    if continue_out and not out.is_dir():
        raise InvalidArgumentError(f"{out} is not a folder an earlier run finished; nothing to go on from")
    _refuse_existing(out, "folder", overwrite or continue_out)
    partial = partial_folder(out)
    if not _open_partial(partial, command, resume) and continue_out:
        shutil.copytree(out, partial, dirs_exist_ok=True)
    yield partial
    _replace(partial, out)


def write_new_file(path: str | Path, text: str, *, overwrite: bool = False) -> Path:
    """Write `text` (UTF-8) to a new file `path`, through a temporary sibling renamed into place."""
    path = Path(path_argument("the file", path)).expanduser()
    _refuse_existing(path, "file", overwrite)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate
        raise InvalidArgumentError(f"cannot write {path}: character {e.start} of the text is not valid Unicode "
                                   f"({e.reason})") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise InvalidArgumentError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the file private, unlike any other write
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a full disk, a folder in the way: the old file is as it was
            raise InvalidArgumentError(f"cannot write {path}: {e.strerror or e}") from None
        raise
    return path
