"""What `LLM.generate` returns and `LLM.stream` yields."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lucebox.errors import TokenizerError
from lucebox.logprobs import TokenLogprob
from lucebox.text.tool_calls import ToolCall


@dataclass
class Chunk:
    """New tokens of one step. `text` is None when the model has no tokenizer."""

    token_ids: list[int]
    text: str | None
    finish_reason: str | None = None  # set on the last chunk: "stop" | "length"
    stats: dict | None = None  # set on the last chunk
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    reasoning: str | None = None  # a chat answer's thought in these tokens (`text` is then its content)


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens only (a stopping EOS or stop token included)
    finish_reason: str  # "stop": EOS, stop token or stop string; "length": max_tokens
    stats: dict = field(default_factory=dict)
    _text: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # a chat answer's calls (`LLM.chat(tools=...)`); its text is then the content beside them
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None  # a chat answer's thought (a reasoning model's); its text is then the rest

    @property
    def text(self) -> str:
        if self._text is None:
            raise TokenizerError("this model has no tokenizer files, so there is no text; use .token_ids")
        return self._text


def collect(chunks: Iterable[Chunk], has_text: bool) -> Generation:
    """The Generation a stream of chunks adds up to (the last chunk carries finish_reason and stats)."""
    token_ids: list[int] = []
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    asked = False  # whether the chunks carry logprobs
    last, thoughts = None, []
    for chunk in chunks:
        token_ids.extend(chunk.token_ids)
        if chunk.reasoning is not None:
            thoughts.append(chunk.reasoning)
        if chunk.logprobs is not None:
            asked = True
            logprobs.extend(chunk.logprobs)
        if chunk.text is not None:
            texts.append(chunk.text)
        last = chunk
    return Generation(token_ids, last.finish_reason, last.stats, "".join(texts) if has_text else None,
                      logprobs if asked else None, reasoning="".join(thoughts) if thoughts else None)
