"""Structured output on /v1/chat/completions and /v1/completions: OpenAI's `response_format`
({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name",
"schema", "strict", "description"}}) and a `grammar` extension (as llama.cpp's server takes: GBNF, or
Lark in llguidance's syntax), checked into `LLM.stream`'s constraint keywords. A value the grammar engine
cannot compile, or one that is not a JSON Schema, is a 400 naming the field; nothing reaches the
engine. `strict` is honoured either way: the output always follows the schema."""

from __future__ import annotations

from lucebox.constrained import Constraint
from lucebox.constrained.spec import refuse_stops
from lucebox.errors import GrammarError

_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def constraint_options(body: dict) -> dict:
    """`LLM.stream` keywords for the request's constraint ({} for none); a GrammarError naming the field."""
    response_format, grammar = body.get("response_format"), body.get("grammar")
    options = _response_format(response_format)
    if options:
        refuse_stops(body.get("stop"), "a JSON response_format", options.get("json_schema", {"type": "object"}))
    if grammar is not None:
        if options:
            raise GrammarError("grammar", "give either grammar or a JSON response_format, not both")
        Constraint.lark(grammar, "grammar")
        options = {"grammar": grammar}
    return options


def _response_format(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise GrammarError("response_format", 'must be {"type": "text"}, {"type": "json_object"} or '
                                              '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise GrammarError(f"response_format.{extra[0]}", f"is not a field of a {kind} response_format")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format.json_schema", "must be an object {name, schema, strict, description}")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise GrammarError(f"response_format.json_schema.{unknown[0]}",
                           f"is not one of {', '.join(sorted(_JSON_SCHEMA_KEYS))}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise GrammarError("response_format.json_schema.name", "is required: a non-empty string")
    for key, kind_ in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise GrammarError(f"response_format.json_schema.{key}", f"must be a {kind_.__name__}")
    if "schema" not in spec:
        raise GrammarError("response_format.json_schema.schema", "is required: the JSON Schema the output follows")
    schema = spec["schema"]
    Constraint.json_schema(schema, "response_format.json_schema.schema")
    return {"json_schema": schema}
