"""`lucebox chat [MODEL]`: a terminal chat over `LLM.chat`. On a terminal: streamed answers, input
history and multi-line editing (prompt_toolkit), slash commands, Ctrl-C to cut an answer short. With
stdin not a terminal: plain mode, one user turn per input line, answers as plain text (for scripts).
Both modes take each input through `ChatInputs.take`: a failing turn or command is one error line and
the chat goes on; plain mode's exit code says whether any failed."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lucebox.chat.slash_commands import ChatCommands
from lucebox.cli.stats_line import stats_line
from lucebox.engine_flags import add_engine_flags, open_engine
from lucebox.errors import LuceboxError

HISTORY_FILE = Path.home() / ".local" / "state" / "lucebox" / "chat_history"
DOUBLE_PRESS_SECONDS = 1.0


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal (streaming, history, /commands)",
                       description="Chat with a model. On a terminal: Enter sends, Alt-Enter (or Esc then Enter) "
                                   "adds a line, Ctrl-C cuts an answer short, Ctrl-D or /exit leaves; /help lists "
                                   "the commands. With stdin not a terminal, each input line is one user turn; "
                                   "a line that fails (a turn too long for the context, a bad /command) prints "
                                   "one error line on stderr and the chat goes on with the next, and the exit "
                                   "code is then 1 (0 when every line succeeded, 2 when the chat cannot start).")
    add_engine_flags(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=None, help="most tokens per answer (default 256)")
    p.add_argument("--temp", type=float, default=None,
                   help="temperature; 0 is greedy (default: the model's generation_config.json, else 0)")
    model = "(default: the model's generation_config.json, else {})"
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens " + model.format("0: off"))
    p.add_argument("--top-p", type=float, help="sample from the smallest set holding this probability "
                                               + model.format("1.0: off"))
    p.add_argument("--min-p", type=float, help="drop tokens below this share of the most likely one "
                                               + model.format("0: off"))
    p.add_argument("--repetition-penalty", type=float,
                   help="CTRL-style penalty of tokens seen " + model.format("1: off"))
    p.add_argument("--seed", type=int, help="sampling seed (default: a fresh one from the OS each answer)")
    p.add_argument("--plain", action="store_true", help="plain mode even on a terminal")


def command(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty() and sys.stdout.isatty() and not args.plain
    out = Console(highlight=False, soft_wrap=True, force_terminal=None if interactive else False)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    llm = _open(args, err)
    sampling = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temp),
                                  ("top_k", args.top_k), ("top_p", args.top_p), ("min_p", args.min_p),
                                  ("repetition_penalty", args.repetition_penalty), ("seed", args.seed))
                if v is not None}
    session = llm.chat(args.system, **sampling)
    inputs = ChatInputs(session, ChatCommands(session, out, err), err)
    if interactive:
        return _interactive(inputs, out)
    return _plain(inputs, out)


class ChatInputs:
    """What both modes share: one input line at a time (a slash command or a user turn) and the one
    error path. A turn or command that fails prints one `error:` line on stderr and the chat goes on
    with the next input; `failed` remembers that one did (plain mode's exit code)."""

    def __init__(self, session, commands: ChatCommands, err: Console) -> None:
        self.session, self.commands, self.err = session, commands, err
        self.failed = False

    def take(self, line: str, answer: Callable[[str], None]) -> bool:
        """Run one input line, `answer(text)` streaming a user turn; False when the chat should end."""
        if not line.strip():
            return True
        try:
            if self.commands.is_command(line):
                return self.commands.run(line)
            answer(self.commands.message(line))
        except LuceboxError as e:
            self.failed = True
            self.err.print(f"[red]error:[/red] {escape(str(e))}")
        return True


def _open(args, err: Console):
    if not err.is_terminal:
        return open_engine(args)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    with Progress(TextColumn("[bold]loading weights"), BarColumn(), DownloadColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("load", total=None)
        return open_engine(args, load_progress=lambda done, total: bar.update(task, completed=done, total=total))


# -- plain mode ---------------------------------------------------------------------------------------


def _plain(inputs: ChatInputs, out: Console) -> int:
    """One user turn per input line; exit code 1 when any input failed (each said so on stderr), else 0."""
    # Input bytes that are not UTF-8 reach the tokenizer as lone surrogates, which it refuses by position,
    # instead of ending the chat with a decoding error; a file name echoed with them prints escaped.
    for stream, errors in ((sys.stdin, "surrogateescape"), (sys.stdout, "backslashreplace")):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)
    for line in sys.stdin:
        if not inputs.take(line.rstrip("\n"), lambda text: _print_answer(inputs.session, text, out)):
            break
    return 1 if inputs.failed else 0


class _AnswerWriter:
    """An answer written as it streams: a reasoning model's thought dimmed (on a terminal), then the
    content after a blank line."""

    def __init__(self, out: Console):
        self.out, self.dim, self.in_thought = out, out.is_terminal, False

    def write(self, chunk) -> None:
        if chunk.reasoning:
            if not self.in_thought:
                self.in_thought = True
                self.out.file.write("\x1b[2m" if self.dim else "")
            self.out.file.write(chunk.reasoning)
        if chunk.text:
            self._close_thought("\n\n")
            self.out.file.write(chunk.text)
        self.out.file.flush()

    def end(self) -> None:
        self._close_thought("")
        self.out.file.write("\n")  # an answer that fails midway still ends its line
        self.out.file.flush()

    def _close_thought(self, then: str) -> None:
        if self.in_thought:
            self.in_thought = False
            self.out.file.write(("\x1b[0m" if self.dim else "") + then)


def _print_answer(session, text: str, out: Console) -> None:
    chunks = session.stream(text)  # a turn refused here (too long for the context, ...) writes nothing
    writer = _AnswerWriter(out)
    try:
        for chunk in chunks:
            writer.write(chunk)
    finally:
        writer.end()


# -- on a terminal ------------------------------------------------------------------------------------


def _interactive(inputs: ChatInputs, out: Console) -> int:
    """Exit code 0: errors were shown as they happened."""
    cut_at = [0.0]  # when Ctrl-C last cut an answer
    prompt = _prompt_session(cut_at)
    session = inputs.session
    llm = session.llm
    draft = "off" if llm.proposer is None else type(llm.proposer).__name__.removesuffix("Proposer")
    out.print(f"[bold]lucebox chat[/bold]  {escape(llm.description.folder.name)} on {llm.device.type} "
              f"({str(llm.dtype).removeprefix('torch.')}), context {llm.max_context} tokens, drafter {draft}"
              + (", plain template (no chat template: the conversation is one document)" if session.plain else ""))
    out.print("[dim]Enter sends · Alt-Enter adds a line · Ctrl-C cuts an answer · /help · Ctrl-D exits[/dim]")

    def answer(text: str) -> None:
        if _answer(session, text, out):
            cut_at[0] = time.monotonic()

    while True:
        try:
            line = prompt.prompt(">>> ")
        except (KeyboardInterrupt, EOFError):
            return 0
        if not inputs.take(line, answer):
            return 0


def _answer(session, text: str, out: Console) -> bool:
    """Streams one answer; True when Ctrl-C cut it."""
    cut = False
    with _interrupts() as asked:
        chunks = session.stream(text)
        writer = _AnswerWriter(out)
        try:
            for chunk in chunks:
                writer.write(chunk)
                if asked():
                    cut = True
                    break
        except KeyboardInterrupt:  # a second Ctrl-C, inside a forward: the session starts its cache over
            cut = True
        finally:
            chunks.close()
            writer.end()
    stats = session.last_stats
    if cut:
        out.print("[yellow]\\[cut: the partial answer stays in the history][/yellow]")
    if stats is not None:
        reason = "cut" if cut else chunk.finish_reason
        out.print(f"[dim]{escape(stats_line(stats, reason, session.llm, full=False))}[/dim]")
    return cut


@contextmanager
def _interrupts():
    """While an answer streams, the first Ctrl-C asks it to stop at the next chunk (the engine stays
    consistent); a second one interrupts at once."""
    count = [0]

    def on_sigint(signum, frame):
        count[0] += 1
        if count[0] > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield lambda: count[0] > 0
    finally:
        signal.signal(signal.SIGINT, previous)


def _prompt_session(cut_at: list[float]):
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @keys.add("c-c")
    def _interrupt(event):
        # Ctrl-C clears a line being typed; on an empty line it leaves, as Ctrl-D does, unless it comes
        # right after a Ctrl-C that cut an answer (a double press meant for the answer).
        if event.current_buffer.text:
            event.current_buffer.reset()
        elif time.monotonic() - cut_at[0] > DOUBLE_PRESS_SECONDS:
            event.app.exit(exception=KeyboardInterrupt())

    try:
        HISTORY_FILE.parent.mkdir(parents=True, exist_ok=True)
        history = FileHistory(str(HISTORY_FILE))
    except OSError:
        history = InMemoryHistory()
    return PromptSession(history=history, key_bindings=keys, multiline=False,
                         prompt_continuation=lambda width, line, wrap: "... ".rjust(width))
