"""Reasoning kept apart from the answer: which reasoning syntax a chat template teaches, and an
answer's text split, as it streams, into its thought and its content.

Two syntaxes, named by `reasoning_format`:
- "think" (Qwen3/3.5/3.6, QwQ, DeepSeek-R1 and its distills): `<think>thought</think>content`. A
  template whose generation prompt opens the thought (DeepSeek-R1's `<think>\\n`) leaves the answer
  inside it (`starts_inside`); an answer that does not begin with `<think>` is all content.
- "harmony" (gpt-oss): messages `<|channel|>NAME<|message|>text<|end|>`, then
  `<|start|>assistant` before the next; the `analysis` channel is the thought, the others content.

The text given here is decoded with special tokens kept (harmony's markers are special tokens). A
piece that could still be the start of a marker waits for the next; the whitespace between the
thought and the content is dropped.
"""

from __future__ import annotations

THINK, HARMONY = "think", "harmony"
FORMATS = (THINK, HARMONY)
OPEN, CLOSE = "<think>", "</think>"
_CHANNEL, _MESSAGE = "<|channel|>", "<|message|>"
_HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
ANALYSIS_HEAD = _CHANNEL + "analysis" + _MESSAGE


def reasoning_format(template: str | None) -> str | None:
    """The reasoning syntax a chat template writes (from the markers it renders), or None."""
    if not template:
        return None
    if _CHANNEL in template:
        return HARMONY
    if OPEN in template or CLOSE in template:
        return THINK
    return None


def starts_inside(fmt: str | None, prompt_text: str) -> bool:
    """Does the prompt leave the answer inside a thought (a generation prompt that opens it)?"""
    tail = prompt_text.rstrip()
    return (fmt == THINK and tail.endswith(OPEN)) or (fmt == HARMONY and tail.endswith(ANALYSIS_HEAD))


def thinking_off(fmt: str | None, prompt_text: str) -> bool:
    """Has the prompt closed the thought already (Qwen3's template with enable_thinking=false writes an
    empty `<think>\\n\\n</think>` for the model)?"""
    return fmt == THINK and prompt_text.rstrip().endswith(CLOSE)


def thought_fields(fmt: str | None, prompt_text: str) -> dict:
    """RequestOptions' `thought_syntax` and `starts_in_thought` for an answer after `prompt_text`: none
    when the model does not think there."""
    if fmt is None or thinking_off(fmt, prompt_text):
        return {}
    return {"thought_syntax": fmt, "starts_in_thought": starts_inside(fmt, prompt_text)}


def _partial(text: str, markers) -> int:
    """How many of the last characters of `text` could begin one of `markers`."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class ReasoningSplit:
    """An answer's text, pushed as it streams, split into (thought, content) pieces."""

    def __init__(self, fmt: str, inside: bool = False):
        self._fmt, self._pending = fmt, ""
        self._state = ("thought_start" if inside else "start") if fmt == THINK else (
            "message" if inside else "between")
        self._channel = "analysis" if inside else None
        self.thought = inside  # whether the answer had a thought (an empty one too)

    @property
    def in_thought(self) -> bool:
        """Is the answer, as far as pushed, inside its thought?"""
        if self._fmt == THINK:
            return self._state in ("thought_start", "thought")
        return self._state == "message" and self._channel == "analysis"

    def push(self, text: str) -> tuple[str, str]:
        self._pending += text
        return self._think(False) if self._fmt == THINK else self._harmony(False)

    def finish(self) -> tuple[str, str]:
        """The pieces held back; the answer has ended."""
        return self._think(True) if self._fmt == THINK else self._harmony(True)

    def _think(self, final: bool) -> tuple[str, str]:
        thought, content = "", ""
        while True:
            pending, state = self._pending, self._state
            if state == "start":
                body = pending.lstrip()
                if body.startswith(OPEN):
                    self._pending, self._state = body[len(OPEN):], "thought_start"
                elif OPEN.startswith(body) and not final:
                    return thought, content
                else:
                    self._state = "content"
            elif state in ("thought_start", "gap"):  # whitespace before the thought, or after it, is dropped
                self.thought = True
                body = pending.lstrip()
                if not body and not final:
                    self._pending = ""
                    return thought, content
                self._pending, self._state = body, ("thought" if state == "thought_start" else "content")
                if final and not body:
                    return thought, content
            elif state == "thought":
                at = pending.find(CLOSE)
                if at >= 0:
                    thought += pending[:at].rstrip()
                    self._pending, self._state = pending[at + len(CLOSE):], "gap"
                    continue
                # a marker's start, and the whitespace before it (a thought ends without it), wait
                cut = len(pending) if final else len(pending[:len(pending) - _partial(pending, (CLOSE,))].rstrip())
                thought += pending[:cut]
                self._pending = pending[cut:]
                return thought, content
            else:
                self._pending = ""
                return thought, content + pending

    def _harmony(self, final: bool) -> tuple[str, str]:
        thought, content = "", ""
        while True:
            pending = self._pending
            if self._state == "between":  # before a message: its header names its channel
                body = pending.lstrip()
                marker_ahead = any(m.startswith(body[:len(m)]) for m in (_CHANNEL, "<|start|>"))
                if self._channel is None and ((body and not marker_ahead) or (final and not body)):
                    self._state = "plain"  # no harmony at all: all of it is content
                    continue
                start = pending.find(_CHANNEL)
                end = pending.find(_MESSAGE, start) if start >= 0 else -1
                if end >= 0:
                    words = pending[start + len(_CHANNEL):end].split()  # "analysis", "commentary to=..."
                    self._channel = words[0] if words else ""
                    self._pending, self._state = pending[end + len(_MESSAGE):], "message"
                    self.thought = self.thought or self._channel == "analysis"
                    continue
                if final:  # text after the last message with no header of its own: content, not lost
                    self._pending = ""
                    rest = body.removeprefix("<|start|>assistant")
                    return thought, content + ("" if any(m.startswith(rest) for m in (_CHANNEL, "<|start|>"))
                                               else rest)
                return thought, content
            if self._state == "plain":
                self._pending = ""
                return thought, content + pending
            ends = [(pending.find(e), e) for e in _HARMONY_ENDS if e in pending]
            at, marker = min(ends) if ends else (-1, "")
            piece = pending[:at] if at >= 0 else pending[:len(pending) - (0 if final else _partial(
                pending, _HARMONY_ENDS))]
            if self._channel == "analysis":
                thought += piece
            else:
                content += piece
            if at < 0:
                self._pending = pending[len(piece):]
                return thought, content
            self._pending, self._state = pending[at + len(marker):], "between"


def split_reasoning(text: str, fmt: str, inside: bool = False) -> tuple[str | None, str]:
    """(the thought, or None when the answer had none; the content) of a whole answer."""
    split = ReasoningSplit(fmt, inside)
    thought, content = split.push(text)
    more_thought, more_content = split.finish()
    return (thought + more_thought if split.thought else None), content + more_content
