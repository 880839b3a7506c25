"""A model looping on its tool calls: once an answer writes a call it already wrote (same name,
same arguments), nothing useful follows, and the engine ends the answer there (`RequestOptions.
end_on_repeated_call`, read by `engine.text_stage`) instead of repeating it until max_tokens. The
calls before the repeat come back whole (`tools.answer`)."""

from __future__ import annotations

from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.reasoning import ReasoningSplit
from lucebox.text.tool_calls import complete_calls, first_repeat

_CALL_ENDS = ("}", ">", "]")  # a call is written whole only at one of these (the JSON's end, a closing tag)


class RepeatedCallWatch:
    def __init__(self, tokenizer, fmt: str, prompt_ids=(), thought: str | None = None, inside: bool = False):
        """`fmt`: the calls' syntax (`text.tool_calls.FORMATS`); the text is decoded with special tokens
        kept (call markers are special tokens in some vocabularies). `thought`: a reasoning model's
        syntax (`inside`: the prompt opened the thought): calls are read after the thought only."""
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=False)
        self._split = ReasoningSplit(thought, inside) if thought is not None else None
        self._fmt, self._text, self.repeated = fmt, "", False

    def push(self, ids) -> bool:
        """Whether the answer, with `ids` added, has repeated a call."""
        piece = self._decoder.push(ids)
        if self._split is not None:
            piece = self._split.push(piece)[1]
        self._text += piece
        if not self.repeated and any(end in piece for end in _CALL_ENDS):
            self.repeated = first_repeat(complete_calls(self._text, self._fmt).calls) is not None
        return self.repeated
