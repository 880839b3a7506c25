"""The `lucebox` command: one module per subcommand, each with `add_parser(sub)` and
`command(args)`. Every LuceboxError becomes one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

from lucebox import __version__
from lucebox.cli.help import show_defaults
from lucebox.engine_flags import in_flag_terms
from lucebox.errors import LuceboxError, LuceboxWarning


def _commands() -> dict:
    """Subcommand name -> its module, in the order `--help` lists them (imported on first use)."""
    from lucebox.benchmark import command as bench
    from lucebox.cli import chat, generate, info, quantize
    from lucebox.server import command as serve
    from lucebox.training import distill_command, train_command

    return {"info": info, "generate": generate, "quantize": quantize, "train": train_command,
            "distill": distill_command, "chat": chat, "bench": bench, "serve": serve}


class _OneLineParser(argparse.ArgumentParser):
    """A flag argparse refuses (a missing value, a value out of range) is one line too, as every other
    error: `lucebox train: error: argument --threads: must be in 1..1024, got -2 (lucebox train --help)`;
    the subcommands' parsers are of this class as well (argparse makes them of the parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="lucebox", description="Single-GPU inference for big open MoE models.")
    parser.add_argument("--version", action="version", version=f"lucebox {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _commands().values():
        module.add_parser(sub)
    for command in sub.choices.values():
        show_defaults(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    warnings.showwarning = _warning_line
    try:
        return _commands()[args.command].command(args)
    except LuceboxError as e:
        print(f"lucebox: error: {in_flag_terms(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lucebox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`lucebox generate ... | head`): stop quietly, like other Unix tools.
        # Python's own flush of stdout at exit would fail again and print a warning: point it at
        # /dev/null first.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file (tests capture it)
            pass
        return 128 + signal.SIGPIPE


_python_warning = warnings.showwarning


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    """lucebox's own warnings as one line in the user's terms; anyone else's as Python shows them."""
    if issubclass(category, LuceboxWarning):
        print(f"lucebox: warning: {in_flag_terms(str(message))}", file=sys.stderr)
    else:
        _python_warning(message, category, filename, lineno, file, line)
