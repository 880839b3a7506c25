"""Which top-level fields a request may hold: the ones the server reads, OpenAI's that mean nothing to a
local server (accepted after a type check, `NO_OP_FIELDS`), and those that would change the output in
ways lucebox cannot (a 422 saying why, `REFUSED_FIELDS`); any other is refused by name, since ignoring
it could change what the client gets."""

from __future__ import annotations

from lucebox.server.api_errors import invalid

# llama.cpp's server (json_schema) and vLLM's (guided_*) constraint fields; lucebox's are
# response_format and grammar (`server.structured`).
_CONSTRAINT_EXTENSIONS = ("json_schema", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                          "structured_outputs")


# Every request field the server reads (or refuses with a reason of its own, below and in
# `server.tools`); any other is refused by name, since ignoring it could change what the client gets.
_FIELDS = {"model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
           "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "logit_bias", "logprobs", "top_logprobs", "response_format", "grammar", "best_of",
           "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", *_CONSTRAINT_EXTENSIONS}
_KIND_FIELDS = {"chat": {"messages", "chat_template_kwargs", "reasoning_effort", "reasoning_budget"},
                "completion": {"prompt", "echo"}}
_BOTH, _CHAT = ("chat", "completion"), ("chat",)


def _text(value) -> bool:
    return isinstance(value, str)


def _text_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _flag(value) -> bool:
    return isinstance(value, bool)


def _object(value) -> bool:
    return isinstance(value, dict)


# OpenAI's fields that mean nothing to a local server: accepted on the endpoints OpenAI takes them on,
# checked for their type (a wrong one is a 422), and otherwise ignored. name: (endpoints, check, type, why)
NO_OP_FIELDS = {
    "user": (_BOTH, _text, "a string", "an end user's id for OpenAI's abuse monitoring; nobody monitors here"),
    "safety_identifier": (_CHAT, _text, "a string", "user's successor, for the same monitoring"),
    "metadata": (_CHAT, _text_map, "an object of strings", "tags for OpenAI's stored completions; nothing is stored"),
    "store": (_CHAT, _flag, "true or false", "whether OpenAI keeps the completion for its evals; nothing is kept"),
    "service_tier": (_CHAT, _text, "a string", "OpenAI's price and latency tier; one engine serves every request"),
    "prompt_cache_key": (_CHAT, _text, "a string", "routes to OpenAI's prompt caches; lucebox reuses the cache "
                                                  "whenever a prompt extends the last one"),
    "prompt_cache_retention": (_CHAT, _text, "a string", "how long OpenAI keeps a prompt cache; lucebox keeps the "
                                                        "last conversation's until another prompt replaces it"),
    "prompt_cache_options": (_CHAT, _object, "an object", "prompt_cache_retention's successor"),
}

# OpenAI's fields that would change the output in ways lucebox cannot: a 422 naming the field and why
# (a null is taken as absent). name: (endpoints, why)
REFUSED_FIELDS = {
    "verbosity": (_CHAT, "asks a model trained for it for longer or shorter answers; lucebox has no such control"),
    "modalities": (_CHAT, "lucebox writes text only: it may be [\"text\"], nothing else"),
    "audio": (_CHAT, "lucebox writes text only, no audio"),
    "prediction": (_CHAT, "predicted outputs are not implemented (lucebox's drafter predicts on its own)"),
    "web_search_options": (_CHAT, "lucebox does not search the web"),
    "moderation": (_CHAT, "lucebox runs no moderation model"),
    "suffix": (("completion",), "inserting text before a suffix (fill-in-the-middle) is not implemented"),
}


def _known_fields(kind: str) -> set[str]:
    extra = {name for name, (kinds, *_) in (NO_OP_FIELDS | REFUSED_FIELDS).items() if kind in kinds}
    return _FIELDS | _KIND_FIELDS[kind] | extra


def check_fields(body: dict, kind: str) -> None:
    """A 422 naming the first field of `body` that a `kind` ("chat" | "completion") request may not hold."""
    _unknown_fields(body, kind)
    _unsupported(body)
    _no_op_fields(body)


def _unknown_fields(body: dict, kind: str) -> None:
    known = _known_fields(kind)
    for name in body:
        if name not in known:
            raise invalid(name, f"is not a field lucebox's {kind} endpoint serves; remove it (the fields it "
                                f"takes: {', '.join(sorted(known - REFUSED_FIELDS.keys()))})")


def _no_op_fields(body: dict) -> None:
    """Each accepted no-op field of the right type (or null), or a 422 naming it."""
    for name, (_, check, kind, _) in NO_OP_FIELDS.items():
        if body.get(name) is not None and not check(body[name]):
            raise invalid(name, f"must be {kind} (lucebox accepts and ignores it)")


def _unsupported(body: dict) -> None:
    """Fields that would change the output in ways lucebox does not implement are refused, not ignored."""
    for name in _CONSTRAINT_EXTENSIONS:  # other servers' ways to constrain the output
        if body.get(name) is not None:
            raise invalid(name, "is not lucebox's way to constrain the output: use response_format (json_object, "
                                "json_schema) or grammar (GBNF or Lark)")
    if body.get("best_of") not in (None, 1):
        raise invalid("best_of", "only best_of=1 is supported")
    for name, (_, why) in REFUSED_FIELDS.items():
        if body.get(name) is not None and not (name == "modalities" and body[name] == ["text"]):
            raise invalid(name, f"is not supported: {why}")
