"""One chat answer's chunks as the session yields them (`AnswerReader`): a reasoning model's thought
split off into `Chunk.reasoning` (`text.answer_split`), the content as `Chunk.text` (with tools, the
text beside the calls, as the server streams it), and the calls parsed; what it adds up to is what the
session records."""

from __future__ import annotations

from dataclasses import replace

from lucebox.generation import Chunk
from lucebox.text.answer_split import AnswerSplit


class AnswerReader:
    def __init__(self, split: AnswerSplit | None, calls):
        """`split`: the answer's thought and content (None: the model does not reason, or this prompt
        turned its thinking off); `calls`: a `tools.ToolCallStream` (None: nothing parsed)."""
        self.split, self.calls = split, calls
        self.generated: list[int] = []
        self.parsed = None  # the calls, once the answer has ended
        self._pieces: list[str] = []
        self._thoughts: list[str] = []
        self._raw: list[str] = []

    def read(self, chunk: Chunk) -> Chunk:
        """The chunk as the session yields it."""
        self.generated += chunk.token_ids
        self._raw.append(chunk.text or "")
        if self.split is not None:
            thought, content = self.split.push(chunk.token_ids, chunk.text)
            if chunk.finish_reason is not None:
                end = self.split.finish(chunk.finish_reason)
                thought, content, self.parsed = thought + end.thought, content + end.content, end.parsed
            chunk = replace(chunk, text=content, reasoning=thought)
            self._thoughts.append(thought)
        elif self.calls is not None:  # the content the calls let out, as the server streams it
            content = self.calls.push(chunk.token_ids)
            if chunk.finish_reason is not None:
                rest, self.parsed = self.calls.finish(chunk.finish_reason)
                content += rest
            chunk = replace(chunk, text=content)
        self._pieces.append(chunk.text or "")
        return chunk

    @property
    def raw(self) -> str:
        """The text the generated tokens spell, as the engine decoded it (thought and calls included)."""
        return "".join(self._raw)

    @property
    def answer(self) -> str:
        """The content so far (all the text, for a model that does not reason)."""
        return "".join(self._pieces)

    @property
    def thought(self) -> str | None:
        """The thought so far; None when the answer has none."""
        return "".join(self._thoughts) if self.split is not None and self.split.had_thought else None
