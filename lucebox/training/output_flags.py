"""`--overwrite` and `--resume` for the commands that train into a new folder (train, distill)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from lucebox.errors import InvalidArgumentError
from lucebox.output import new_folder, output_path

STATE = Path("training") / "state.pt"  # what --resume goes on from


def add_output_flags(p: argparse.ArgumentParser, state: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output folder (it is kept until the new one is complete)")
    p.add_argument("--resume", action="store_true",
                   help=f"go on from a finished earlier run in the output folder ({state}) to --steps, "
                        "then replace it")


@contextlib.contextmanager
def output_folder(args, command: str, out: str | None = None, reads: tuple[str, ...] = ()) -> Iterator[Path]:
    """The folder the command writes (`OUT.partial`, renamed to OUT when the block ends cleanly)."""
    out = output_path(args.out if out is None else out)  # "" (an unset variable) stays empty, and is refused
    if args.resume and args.overwrite:
        raise InvalidArgumentError("--resume goes on from OUT and --overwrite starts over: give one of them")
    if args.resume and not (out / STATE).is_file():
        raise InvalidArgumentError(f"--resume: {out / STATE} does not exist; nothing to go on from")
    # --overwrite starts over: an interrupted run's OUT.partial is not gone on from either.
    with new_folder(out, command, overwrite=args.overwrite, resume=not args.overwrite, continue_out=args.resume,
                    reads=reads) as partial:
        yield partial
