"""`--help` that shows every flag's default: a flag whose help does not say its default gets
"(default: X)" from argparse's own default, so the text can never disagree with the parser."""

from __future__ import annotations

import argparse


def help_text(action: argparse.Action) -> str:
    """The help of `action`, ending in its default unless it already names one."""
    text = action.help or ""
    if "default" in text or action.default is argparse.SUPPRESS:  # SUPPRESS: --help, --version
        return text
    if action.nargs == 0:  # a switch: store_true and the like
        shown = "on" if action.default else "off"
    elif action.default is None or action.default == []:
        shown = "none"
    else:
        shown = str(action.default)
    return f"{text} (default: {shown})".lstrip()


class _WithDefaults:
    def _get_help_string(self, action: argparse.Action) -> str:  # argparse's documented hook (as in its own
        return help_text(action)  # ArgumentDefaultsHelpFormatter)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Make `parser`'s help (a subcommand's) show every default, keeping its own formatting."""
    base = parser.formatter_class
    parser.formatter_class = type(f"Defaults{base.__name__}", (_WithDefaults, base), {})
