"""Whether a JSON text follows a JSON Schema, checked by the grammar engine that constrains output
(so "follows" means the same thing in both places). For output that was not constrained but comes
with a promise: a `strict` tool called under tool_choice "auto" (`lucebox.tools`)."""

from __future__ import annotations

import functools

from lucebox.constrained.bounds import check_schema
from lucebox.constrained.native import on_compile_stack
from lucebox.constrained.spec import llguidance

_EOS = 256  # the byte vocabulary's one extra token


class _Bytes:
    """A vocabulary of the 256 bytes (and an end token), as llguidance's TokenizerWrapper reads one:
    text is checked byte by byte, whatever model wrote it."""

    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [_EOS]
    eos_token_id, bos_token_id = _EOS, None

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("text only")
        return list(text.encode())


@functools.lru_cache(maxsize=1)
def _byte_vocabulary():
    engine = llguidance()
    return engine.LLTokenizer(engine.TokenizerWrapper(_Bytes()))


def follows_schema(text: str, schema: dict) -> bool:
    """Is `text` one JSON value (any whitespace between its parts) that `schema` accepts? `schema`
    meets the bounds every schema meets before the engine sees it (a GrammarError otherwise)."""
    check_schema(schema, "parameters")
    engine = llguidance()
    return on_compile_stack(_follows, engine, text, schema)


def _follows(engine, text: str, schema: dict) -> bool:
    grammar = engine.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
    matcher = engine.LLMatcher(_byte_vocabulary(), grammar, log_level=0)
    return matcher.consume_tokens(list(text.strip().encode())) and matcher.is_accepting()
