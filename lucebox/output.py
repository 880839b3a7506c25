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
import ctypes
import os
import shutil
import stat
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
    if what == "file" and (target.is_symlink() or not stat.S_ISREG(target.lstat().st_mode)):
        # /dev/null, a FIFO, a link (/dev/stdout): renaming a new file over it would replace the node itself
        raise OutputExistsError(f"{target} exists and is not a regular file; --overwrite replaces regular files only")


def _holds(folder: Path, source: Path) -> bool:
    """Would replacing or removing `folder` remove `source`?"""
    try:
        folder, source = folder.resolve(), source.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        raise InvalidArgumentError(f"cannot place {folder}: {e}") from None
    return folder == source or folder in source.parents


def partial_folder(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def _open_partial(partial: Path, command: str, resume: bool) -> bool:
    """Make `partial`, or keep it (to resume) if this command made it; True if it was kept. A
    partial folder of this command that cannot be resumed is its own leftover and starts afresh."""
    if partial.exists() or partial.is_symlink():
        marker = partial / PARTIAL_MARKER
        if partial.is_symlink() or not marker.is_file():
            raise OutputExistsError(f"{partial} exists and was not made by lucebox; move it away first (lucebox "
                                    "writes there before renaming to the folder asked for)")
        made_by = marker.read_text(errors="replace").strip()
        if made_by != command:
            raise OutputExistsError(f"{partial} holds an unfinished `{made_by}` run; finish it (run it again) or "
                                    "remove the folder first")
        if resume:
            return True
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / PARTIAL_MARKER).write_text(command + "\n")
    return False


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step where the system can (Linux's renameat2); False where not."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


def _replace(partial: Path, out: Path, overwrite: bool) -> None:
    """Make the finished `partial` the folder `out`. An `out` that appeared while the command ran is
    refused unless `overwrite`; an `out` being replaced swaps places with `partial` in one step
    (where the system allows; else it is renamed aside first), then is removed."""
    _refuse_existing(out, "folder", overwrite)
    (partial / PARTIAL_MARKER).unlink()
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        partial.rename(out)
    elif _exchange(partial, out):
        shutil.rmtree(partial)
    else:
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        old.rmdir()
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)


def _places_it_would_delete() -> list[tuple[Path, str]]:
    """Folders whose replacement would delete the user's own work, each with how it is named."""
    places = []
    with contextlib.suppress(RuntimeError):  # no home folder known (HOME unset, no passwd entry)
        places.append((Path.home(), "your home folder"))
    try:
        places.append((Path.cwd(), "the current folder"))
    except OSError:  # the current folder was deleted: a relative output is refused by output_path
        pass
    return places


def output_path(out: str | Path, what: str = "folder") -> Path:
    """The absolute path of an output `what` ("folder" or "file"), refused whatever --overwrite says
    when it is empty (an unset shell variable), the filesystem root, or the current folder, the
    home folder or a folder above either: replacing it would delete the user's files."""
    given = os.fsdecode(path_argument(f"the output {what}", out))
    if not given.strip():
        raise InvalidArgumentError(f"the output {what} is empty (an unset variable?); name a new {what}")
    try:
        # joined, not normalized: "link/../x" is where the system puts it, beside link's target, which a
        # lexical ".." (os.path.abspath) would move beside the link
        path = Path.cwd() / Path(given).expanduser()
    except OSError as e:  # a relative path from a current folder that no longer exists
        raise InvalidArgumentError(f"cannot place {given}: {e.strerror or e}; give an absolute path") from None
    except RuntimeError:  # ~name of no user
        raise InvalidArgumentError(f"cannot place {given}: no home folder for {given.split('/')[0]}") from None
    if path == path.parent:
        raise InvalidArgumentError(f"{given} is not a {what} lucebox can create: it is the root of the filesystem")
    for place, named in _places_it_would_delete():
        if _holds(path, place):
            relation = "is" if path.resolve() == place.resolve() else "holds"
            raise InvalidArgumentError(f"{given} is not a {what} lucebox can create: it {relation} {named} "
                                       f"({place}), whose files it would delete; name a new {what}")
    return path


@contextlib.contextmanager
def new_folder(out: str | Path, command: str, *, overwrite: bool = False, resume: bool = False,
               continue_out: bool = False, reads: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yield the folder to write `out` into (`OUT.partial`); on a clean exit it becomes `out`.

    `command` names the command in `OUT.partial`'s marker: only the same command reuses it.
    `resume`: keep what an earlier interrupted run of this command left in `OUT.partial`.
    `continue_out`: the user asked to go on from a finished `out` (e.g. `--resume`): a fresh
    partial folder starts as a copy of it, and `out` is replaced at the end.
    `reads`: files and folders the command reads from; neither `out` nor `OUT.partial` may be or
    hold any of them."""
    out = output_path(out)
    partial = partial_folder(out)
    for source in reads:
        if _holds(out, Path(source).expanduser()) or _holds(partial, Path(source).expanduser()):
            raise InvalidArgumentError(f"{out} holds {source}, which this command reads; choose another folder")
    if continue_out and not out.is_dir():
        raise InvalidArgumentError(f"{out} is not a folder an earlier run finished; nothing to go on from")
    _refuse_existing(out, "folder", overwrite or continue_out)
    try:
        if not _open_partial(partial, command, resume) and continue_out:
            shutil.copytree(out, partial, dirs_exist_ok=True)
    except OSError as e:
        raise InvalidArgumentError(f"cannot create {partial}: {e.strerror or e}") from None
    try:
        yield partial
    except BaseException:  # an error or Ctrl-C: keep what a run can go on from, and nothing else
        if not any(p.is_file() and p.name != PARTIAL_MARKER for p in partial.rglob("*")):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        _replace(partial, out, overwrite or continue_out)
    except OSError as e:
        raise InvalidArgumentError(f"cannot move the finished {partial} to {out} ({e.strerror or e}); the result "
                                   f"is complete in {partial}") from None


def write_new_file(path: str | Path, text: str | bytes, *, overwrite: bool = False) -> Path:
    """Write `text` (str: as UTF-8; or bytes) to a new file `path`, through a temporary sibling renamed
    into place."""
    given = os.fsdecode(path_argument("the file", path))
    path = output_path(given, "file")
    if given.endswith(("/", os.sep)) or os.path.basename(given) in (".", "..") or path.is_dir():
        raise InvalidArgumentError(f"{given} is a folder; give a file name")
    _refuse_existing(path, "file", overwrite)
    try:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
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
    return Path(given).expanduser()  # as the caller named it
