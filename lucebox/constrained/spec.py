"""A request's output constraint, checked and compiled to llguidance's grammar text before anything
reaches the engine: a JSON schema (a dict, or its JSON text), JSON mode (any JSON object) or a Lark
grammar. Whatever the engine cannot compile is a GrammarError naming the argument it came from."""

from __future__ import annotations

from dataclasses import dataclass

from lucebox import bounded_json
from lucebox.constrained.bounds import check_grammar, check_schema, one_line
from lucebox.constrained.native import on_compile_stack
from lucebox.errors import GrammarError, JSONInputError
from lucebox.request_options import chosen_constraint

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
        """A JSON Schema given as a dict or as JSON text, within `bounds` (checked before the engine sees it)."""
        if isinstance(value, str):
            try:
                value = bounded_json.loads(value, "the schema's JSON text")
            except JSONInputError as e:
                raise GrammarError(field, f"{e}; give a JSON Schema object") from None
        if not isinstance(value, dict):
            raise GrammarError(field, f"must be a JSON Schema object (a dict), got {type(value).__name__}")
        options = value.get("x-guidance", {})
        if not isinstance(options, dict):
            raise GrammarError(f"{field}.x-guidance", "must be an object of llguidance's JSON options (like "
                                                      f'{{"whitespace_flexible": true}}), got {type(options).__name__}')
        check_schema(value, field)
        try:
            text = on_compile_stack(llguidance().LLMatcher.grammar_from_json_schema, value, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise GrammarError(field, f"is not a JSON Schema the grammar engine can read: {one_line(e)}") from None
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

        check_grammar(value, field)  # GBNF's rules counted before the translation
        try:
            lark = any_to_lark(value)
        except Exception as e:  # its parser's own errors (ValueError, AssertionError, ...), named in the message
            raise GrammarError(field, f"is neither Lark nor GBNF the engine reads: {type(e).__name__}: "
                                      f"{one_line(e)}") from None
        check_grammar(lark, field)
        return cls._checked(on_compile_stack(llguidance().LLMatcher.grammar_from_lark, lark), field)

    @classmethod
    def _checked(cls, text: str, field: str) -> Constraint:
        engine = llguidance()
        failed, messages = on_compile_stack(engine.LLMatcher.validate_grammar_with_warnings, text)
        if failed:
            raise GrammarError(field, f"the grammar engine cannot compile it: {one_line(messages[0])}")
        return cls(text, field)


def refuse_stops(stop, constraint: str, schema=None) -> None:
    """A stop string would end constrained JSON wherever it appears in it (a stop of ":" cuts the object
    at its first key): with JSON output (a schema, JSON mode, tool calls) such stop strings are refused,
    naming `stop`; the output ends by itself once the JSON is complete. Kept: one with a control
    character (a newline) beside compact JSON (`schema`'s output, JSON_DEFAULTS), which never writes one."""
    harmless = schema is not None and _compact(schema)
    stops = [stop] if isinstance(stop, str) else stop or []  # one stop string, or a list of them
    cutting = [s for s in stops if not (harmless and _has_control(s))]
    if cutting:
        raise GrammarError("stop", f"{cutting[0]!r} cannot be used with {constraint}: a stop string can end the "
                                   "output inside the JSON, which then is not JSON; leave stop out (the output ends "
                                   "where the JSON is complete)")


def _compact(schema) -> bool:
    """Is `schema`'s output compact JSON (no whitespace of the schema's own choosing: x-guidance)?"""
    if isinstance(schema, str):
        try:
            schema = bounded_json.loads(schema, "the schema's JSON text")
        except JSONInputError:
            return False
    given = schema.get("x-guidance") or {} if isinstance(schema, dict) else None
    if not isinstance(given, dict):
        return False
    options = {**JSON_DEFAULTS, **given}
    separators = [v for v in options.values() if isinstance(v, str)]  # item_separator, key_separator
    return (options.get("whitespace_flexible") is False and options.get("whitespace_pattern") is None
            and not any(_has_control(v) for v in separators))


def _has_control(text: str) -> bool:
    return any(ord(c) < 0x20 for c in text)


def constraint_from(json_schema=None, grammar=None, json_object=False) -> Constraint | None:
    """The one constraint `LLM.stream`'s arguments ask for (`RequestOptions`' constraint fields), or None."""
    given = chosen_constraint(json_schema, grammar, json_object)
    if given == "json_schema":
        return Constraint.json_schema(json_schema)
    if given == "grammar":
        return Constraint.lark(grammar)
    return Constraint.json_object() if given else None
