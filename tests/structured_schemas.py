"""Small JSON schemas for constrained-output tests: every feature the issue names (nested objects,
arrays, enums, bounded numbers, required and optional fields, strings with patterns), each
bounded so that the built-in code model (which never writes JSON on its own) finishes in a few
dozen tokens."""


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


WORD = {"type": "string", "maxLength": 6}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS = [
    _obj({"name": WORD}),
    _obj({"age": SMALL}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"level": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    _obj({"xs": {"type": "array", "items": SMALL, "maxItems": 3}}),
    _obj({"name": WORD, "age": SMALL}, required=["name"]),  # an optional field
    _obj({"id": SMALL, "note": WORD}, required=[]),  # every field optional
    _obj({"point": _obj({"x": SMALL, "y": SMALL})}),  # nested
    _obj({"user": _obj({"name": WORD, "role": {"enum": ["admin", "dev"]}})}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),  # three deep
    _obj({"items": {"type": "array", "items": _obj({"k": {"enum": ["x", "y"]}}), "maxItems": 2}}),
    _obj({"kind": {"const": "file"}, "size": SMALL}),
    _obj({"value": {"anyOf": [SMALL, {"type": "null"}]}}),
    _obj({"mode": {"type": "string", "enum": ["r", "w"]}, "flags": {"type": "array", "items": {"type": "boolean"},
                                                                   "maxItems": 2}}),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},  # not an object at the top
    _obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]$"}, "stable": {"type": "boolean"}}),
    {"enum": ["yes", "no"]},
]
