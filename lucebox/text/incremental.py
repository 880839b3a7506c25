"""Streaming detokenization: generated ids become text as they arrive, one finished character at a time."""

from __future__ import annotations

from collections.abc import Sequence

from lucebox.text.tokenizer import Tokenizer


class IncrementalDecoder:
    """Streams generated ids as text: pushes + flush() == decode(generated ids) when prompt_ids is ().

    Each push decodes a window starting before the new ids and returns the text past its old end (vLLM's
    scheme), so sentencepiece's leading space sees its neighbour. Text ending in U+FFFD is an unfinished UTF-8
    character and waits for the next ids. With prompt_ids the output is what generation appends to the decoded
    prompt: the same for byte-level BPE, but sentencepiece then keeps the first token's leading space.
    """

    _CONTEXT = 5  # prompt ids kept as context, as vLLM does

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        # _ids[:_read] is text already returned (or prompt); it is the window's context for the next push
        self._ids = [int(i) for i in list(prompt_ids)[-self._CONTEXT:]]
        self._read = len(self._ids)

    def _advance(self, final: bool) -> str:
        before = self._tok.decode(self._ids[:self._read], skip_special_tokens=self._skip)
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        # the ids just turned into text are the next window's context; older ids are no longer needed
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return text[len(before):]

    def push(self, ids: Sequence[int]) -> str:
        """Adds generated ids; returns the text they finished (possibly "")."""
        self._ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Returns whatever is held back (an unfinished character decodes to U+FFFD here)."""
        return self._advance(final=True)
