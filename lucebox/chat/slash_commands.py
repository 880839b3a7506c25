"""The chat's slash commands (/help, /reset, /save, /load, /stats, /set, /exit). A bad command or
value raises a LuceboxError; the chat's loop (command.py) prints it as one line and goes on."""

from __future__ import annotations

import re
import shlex

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lucebox.errors import LuceboxError
from lucebox.limits import DECODE_ROWS, DRAFT_WIDTH

HELP = [
    ("/help", "this list"),
    ("/reset", "forget the conversation (the system prompt stays)"),
    ("/save FILE", "write the conversation as JSON to a new file"),
    ("/save FILE --overwrite", "replace an existing FILE (once the new one is complete)"),
    ("/load FILE", "replace the conversation with a saved one (prefills it again)"),
    ("/stats", "speed, acceptance, context and KV memory of the last answer"),
    ("/set key=value ...", "temp top_p top_k min_p repetition_penalty max_tokens seed stop draft_k "
                           "(no arguments: show them); e.g. /set temp=0.7 max_tokens=256 stop=\\n\\n"),
    ("/exit", "leave (also Ctrl-D, or Ctrl-C at an empty prompt)"),
    ("//text", "send text that starts with /"),
]
OVERWRITE = "--overwrite"  # /save FILE --overwrite replaces FILE
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}
# /set names -> (session setting, parser); "none" clears seed and stop.
SETTABLE = {
    "temp": ("temperature", float), "temperature": ("temperature", float), "top_p": ("top_p", float),
    "top_k": ("top_k", int), "min_p": ("min_p", float), "repetition_penalty": ("repetition_penalty", float),
    "max_tokens": ("max_tokens", int), "seed": ("seed", int), "stop": ("stop", str), "draft_k": ("draft_k", int),
}


class CommandError(LuceboxError):
    """A slash command the chat cannot run as typed."""


class ChatCommands:
    def __init__(self, session, out: Console, err: Console) -> None:
        self.session, self.out, self.err = session, out, err

    @staticmethod
    def is_command(text: str) -> bool:
        return text.startswith("/") and not text.startswith("//")

    @staticmethod
    def message(text: str) -> str:
        """What a typed line sends: `//...` escapes a leading slash."""
        return text[1:] if text.startswith("//") else text

    def run(self, line: str) -> bool:
        """Run one command; False when the chat should end. A command that cannot run raises a LuceboxError."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        handlers = {"/help": self._help, "/reset": self._reset, "/save": self._save, "/load": self._load,
                    "/stats": self._stats, "/set": self._set}
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name not in handlers:
            raise CommandError(f"unknown command {name}; /help lists the commands")
        handlers[name](rest)
        return True

    def _help(self, rest: str) -> None:
        for usage, what in HELP:
            self.out.print(f"  [bold]{escape(usage):<24}[/bold] {escape(what)}")

    def _reset(self, rest: str) -> None:
        self.session.reset()
        self.out.print("conversation cleared")

    def _file(self, rest: str, command: str, flags: tuple[str, ...] = ()) -> tuple[str, set[str]]:
        """The one file name a command takes, split as a shell splits it (quote a name with spaces), and
        the flags of `flags` given after it; anything else is a CommandError, never a file of that name."""
        example = f'e.g. {command} chat.json, or {command} "my chat.json"'
        lexer = shlex.shlex(rest, posix=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        lexer.escape = ""  # a backslash is part of a name (a\b.json), not an escape to drop silently
        try:
            words = list(lexer)
        except ValueError as e:  # an unclosed quote
            raise CommandError(f"{command}: {e}; {example}") from None
        given = {w for w in words if w.startswith("--")}
        names = [w for w in words if not w.startswith("--")]
        if given - set(flags):
            raise CommandError(f"{command} does not take {sorted(given - set(flags))[0]}; {example}")
        if len(names) != 1 or not names[0].strip():
            raise CommandError(f"{command} takes one file name, got {len(names) if names and names[0].strip() else 0}"
                               f"; {example}")
        return names[0], given

    def _save(self, rest: str) -> None:
        path, flags = self._file(rest, "/save", (OVERWRITE,))
        self.session.save(path, overwrite=OVERWRITE in flags)
        self.out.print(f"saved {len(self.session.messages)} messages to {escape(path)}")

    def _load(self, rest: str) -> None:
        path, _ = self._file(rest, "/load")
        try:
            self._prefill_saved(path)
        except KeyboardInterrupt:  # the session kept the conversation it had; its next turn prefills it again
            self.out.print("load cancelled: the conversation is as it was")
            return
        self.out.print(f"loaded {len(self.session.messages)} messages ({self.session.context_tokens} tokens) "
                       f"from {escape(path)}")

    def _prefill_saved(self, path: str) -> None:
        if self.err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            with Progress(TextColumn("[bold]prefilling the conversation"), BarColumn(), MofNCompleteColumn(),
                          console=self.err, transient=True) as bar:
                task = bar.add_task("prefill", total=None)
                self.session.load(path, lambda done, total: bar.update(task, completed=done, total=total))
        else:
            self.session.load(path)

    def _set(self, rest: str) -> None:
        if not rest:
            shown = {**self.session.settings, "draft_k": self.session.llm.draft_k}
            self.out.print("  ".join(f"{k}={v!r}" for k, v in shown.items()))
            return
        changes, draft_k = {}, None
        for item in rest.split():
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise CommandError(f"/set takes key=value pairs, got {item!r}; e.g. /set temp=0.7")
            if key not in SETTABLE:
                raise CommandError(f"/set does not know {key!r}; it knows {', '.join(SETTABLE)}")
            name, kind = SETTABLE[key]
            parsed = _parse(key, value, kind)
            if name == "draft_k":
                draft_k = parsed
            else:
                changes[name] = [parsed] if name == "stop" and parsed is not None else parsed
        if draft_k is not None and not 1 <= draft_k <= DRAFT_WIDTH:
            raise CommandError(f"draft_k must be in 1..{DRAFT_WIDTH} (a verify step holds at most {DECODE_ROWS} rows), "
                               f"got {draft_k}")
        self.session.set(**changes)  # checks every value before it changes any
        if draft_k is not None:
            self.session.llm.draft_k = draft_k
        self.out.print("set " + " ".join(f"{k}={v!r}" for k, v in {**changes, **(
            {"draft_k": draft_k} if draft_k is not None else {})}.items()))

    def _stats(self, rest: str) -> None:
        session, llm = self.session, self.session.llm
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        s = session.last_stats
        if s is None:
            table.add_row("last answer", "none yet (or cut during its prefill)")
        else:
            if s.get("cut"):
                table.add_row("last answer", "cut short: the figures up to the cut")
            prefilled = s["prompt_tokens"] - s["cached_prompt_tokens"]
            table.add_row("prompt tokens", f"{s['prompt_tokens']} (prefilled {prefilled}, reused "
                                           f"{s['cached_prompt_tokens']} from the cache)")
            table.add_row("prefill", f"{s['prefill_tokens_per_s']:.1f} tokens/s")
            table.add_row("decode", f"{s['decode_tokens_per_s']:.1f} tokens/s ({s['generated_tokens']} tokens)")
            if llm.proposer is not None:
                table.add_row("acceptance length", f"{s['acceptance_length']:.2f} tokens per round "
                                                   f"({s['rounds']} rounds)")
                table.add_row("width histogram", _histogram(s["width_histogram"]) + "  (drafts verified: rounds)")
                table.add_row("accepted histogram", _histogram(s["accepted_histogram"]) + "  (drafts kept: rounds)")
        table.add_row("context", f"{session.context_tokens} of {llm.max_context} tokens")
        memory = llm.memory()
        device_kv = memory["ring_caches"] + memory["kv_pool_device"] + memory["kv_chunk_summaries"]
        table.add_row("KV memory", f"device {_mib(device_kv)}, host {_mib(memory['kv_host'])}")
        table.add_row("weights", _mib(memory["weights"]) + (f" + drafter {_mib(memory['drafter'])}"
                                                             if memory["drafter"] else ""))
        self.out.print(table)


def _parse(key: str, value: str, kind):
    if value.lower() == "none" and key in ("seed", "stop"):
        return None
    if kind is str:  # so that /set stop=\n\n means two newlines
        return re.sub(r"\\([nrt\\])", lambda m: ESCAPES[m.group(1)], value)
    try:
        return kind(value)
    except ValueError:
        raise CommandError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}") from None


def _histogram(counts: dict) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items())) or "-"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
