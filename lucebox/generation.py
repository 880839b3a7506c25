"""What `LLM.generate` returns and `LLM.stream` yields."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lucebox.errors import TokenizerError


@dataclass
class Chunk:
    """New tokens of one step. `text` is None when the model has no tokenizer."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length"
    stats: dict | None = None  # set on the last chunk


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only (a stopping EOS or stop token included)
    finish_reason: str  # "stop": EOS, stop token or stop string; "length": max_tokens
    stats: dict = field(default_factory=dict)
    _text: str | None = None

    @property
    def text(self) -> str:
        if self._text is None:
            raise TokenizerError("this model has no tokenizer files, so there is no text; use .token_ids")
        return self._text


def collect(chunks: Iterable[Chunk], has_text: bool) -> Generation:
    """The Generation a stream of chunks adds up to (the last chunk carries finish_reason and stats)."""
    token_ids: list[int] = []
    texts: list[str] = []
    last = None
    for chunk in chunks:
        token_ids.extend(chunk.token_ids)
        if chunk.text is not None:
            texts.append(chunk.text)
        last = chunk
    return Generation(token_ids, last.finish_reason, last.stats, "".join(texts) if has_text else None)
