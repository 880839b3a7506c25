"""A request's output constraint, checked and compiled to llguidance's grammar text before anything
reaches the engine: a JSON schema (a dict, or its JSON text), JSON mode (any JSON object) or a Lark
grammar. Whatever the engine cannot compile is a GrammarError naming the argument it came from."""

from __future__ import annotations

import json
from dataclasses import dataclass

from lucebox.errors import GrammarError

# Compact JSON unless a schema's own "x-guidance" says otherwise: free whitespace lets a small model
# fill max_tokens with newlines between two keys, and no reader needs it.
JSON_DEFAULTS = {"whitespace_flexible": False}
INSTALL = "pip install llguidance"


def llguidance():
    """The engine's module, or a GrammarError saying how to install it."""
    try:
        import llguidance as engine
    except ImportError:
        raise GrammarError("json_schema/grammar", f"constrained output needs llguidance: {INSTALL}") from None
    return engine


@dataclass(frozen=True)
class Constraint:
    """llguidance grammar text (its JSON form, made by its compilers) and the argument it came from."""

    grammar: str
    field: str

    @classmethod
    def json_schema(cls, value, field: str = "json_schema") -> Constraint:
        """A JSON Schema given as a dict or as JSON text."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(field, f"is not valid JSON ({e}); give a JSON Schema object") from None
        if not isinstance(value, dict):
            raise GrammarError(field, f"must be a JSON Schema object (a dict), got {type(value).__name__}")
        try:
            text = llguidance().LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise GrammarError(field, f"is not a JSON Schema the grammar engine can read: {e}") from None
        return cls._checked(text, field)

    @classmethod
    def json_object(cls, field: str = "json_object") -> Constraint:
        """JSON mode: any JSON object."""
        return cls.json_schema({"type": "object"}, field)

    @classmethod
    def lark(cls, value, field: str = "grammar") -> Constraint:
        """A grammar in llguidance's Lark syntax (`start: ...`), or in llama.cpp's GBNF (`root ::= ...`),
        which llguidance translates to Lark."""
        if not isinstance(value, str) or not value.strip():
            raise GrammarError(field, "must be a non-empty grammar string: Lark (llguidance's syntax, e.g. "
                                      "'start: \"yes\" | \"no\"') or GBNF ('root ::= \"yes\" | \"no\"')")
        llguidance()
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(value)
        except Exception as e:  # its parser's own errors (ValueError, AssertionError, ...), named in the message
            raise GrammarError(field, f"is neither Lark nor GBNF the engine reads: {type(e).__name__}: {e}") from None
        return cls._checked(llguidance().LLMatcher.grammar_from_lark(lark), field)

    @classmethod
    def _checked(cls, text: str, field: str) -> Constraint:
        engine = llguidance()
        failed, messages = engine.LLMatcher.validate_grammar_with_warnings(text)
        if failed:
            raise GrammarError(field, f"the grammar engine cannot compile it: {messages[0]}")
        return cls(text, field)


def constraint_from(json_schema=None, grammar=None, json_object=False) -> Constraint | None:
    """The one constraint `LLM.stream`'s arguments ask for, or None."""
    if not isinstance(json_object, bool):
        raise GrammarError("json_object", f"must be True or False, got {json_object!r}")
    given = [name for name, value in (("json_schema", json_schema), ("grammar", grammar),
                                      ("json_object", json_object or None)) if value is not None]
    if len(given) > 1:
        raise GrammarError(given[1], f"give one of json_schema, grammar, json_object, not {' and '.join(given)}")
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if grammar is not None:
        return Constraint.lark(grammar)
    return Constraint.json_object() if json_object else None
