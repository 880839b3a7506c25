"""The OpenAI API's request and response shapes: requests checked field by field into what
`LLM.stream` takes (errors in OpenAI's JSON: `api_errors`), and the completion objects and stream chunks."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from lucebox import arguments
from lucebox.errors import GrammarError, InvalidArgumentError
from lucebox.server.api_errors import APIError, invalid
from lucebox.server.choices import choices_field
from lucebox.server.logprobs_format import logprobs_field
from lucebox.server.request_fields import check_fields
from lucebox.server.structured import constraint_options
from lucebox.server.tools import tool_message

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4  # as OpenAI's API
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass
class GenerationRequest:
    """One completion request, checked: the prompt (messages or text or ids) and `LLM.stream` options."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None  # None: what the context leaves
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    echo_text: str = ""  # what an echo puts before the answer: the prompt, as text (`app`)
    # temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed, logit_bias
    sampling: dict = field(default_factory=dict)
    n: int = 1  # choices (`server.choices`)
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest (`server.logprobs_format`)
    stop: list[str] = field(default_factory=list)
    constraint: dict = field(default_factory=dict)  # json_schema | json_object | grammar (`server.structured`)
    tools: object = None  # a `lucebox.tools.ToolRequest`, or None


def _number(body: dict, name: str, low: float, high: float, integer: bool = False, low_open: bool = False):
    """The field checked by the engine's own argument checks; their error as a 422 naming the field."""
    value = body.get(name)
    if value is None:
        return None
    try:
        if integer:
            return arguments.integer(name, value, low, high)
        return arguments.number(name, value, low, high, low_open=low_open)
    except InvalidArgumentError as e:
        raise APIError(422, str(e), name) from None


def _stops(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return stops


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):
            messages.append(tool_message(m, i, _content(m, i)))
        else:
            messages.append({"role": role, "content": _content(m, i)})
    return messages


def _logit_bias(value, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings), checked as `LLM.stream` checks it."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", 'must be an object of token ids to biases, like {"50256": -100}')
    biases = {}
    for key, bias in value.items():
        # ten digits: past any vocabulary, and int() of them is cheap (of 4,300 and more, it raises)
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid("logit_bias", f"key {key[:20]!r} is not a token id (a non-negative integer)")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise invalid("logit_bias", f"the bias of {key} must be a number in -100..100, got {bias!r}")
        biases[int(key)] = bias
    try:
        return arguments.token_biases("logit_bias", biases, vocab_size)
    except InvalidArgumentError as e:
        raise APIError(422, str(e), "logit_bias") from None


def _check_text(body: dict) -> None:
    """400 for a string anywhere in the request that is not valid Unicode. JSON can carry a lone
    surrogate ("\\ud800"), which no tokenizer encodes and no answer can quote back; checked once here,
    for every field, before any field is read."""
    pending = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str) and (at := _surrogate_at(value)) is not None:
            raise APIError(400, f"{path}: character {at} is a lone surrogate (U+{ord(value[at]):04X}); "
                                "text must be valid Unicode", path, "invalid_text")
        if isinstance(value, dict):
            for key, item in value.items():
                if _surrogate_at(key) is not None:
                    raise APIError(400, f"{path or 'the request'}: a key holds a lone surrogate; text must be "
                                        "valid Unicode", path or None, "invalid_text")
                pending.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone surrogate (a code point UTF-8 cannot write), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def echo_text(prompt: str | list[int], tokenizer) -> str:
    """The prompt as `echo` writes it back: as given, or its token ids decoded (special tokens too: the ids
    the model read); a 422 naming `echo` when the model has no tokenizer to decode them."""
    if isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise invalid("echo", "this model has no tokenizer files, so token ids cannot be echoed as text")
    return tokenizer.decode(prompt, skip_special_tokens=False)


def parse_request(body, kind: str, vocab_size: int) -> GenerationRequest:
    """A checked request from a decoded JSON body (`kind`: "chat" or "completion")."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_text(body)
    check_fields(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", "must be a string")
    request = GenerationRequest(kind, model)
    if kind == "chat":
        if "messages" not in body:
            raise APIError(400, "messages is required", "messages")
        request.messages = _messages(body["messages"])
    else:
        if "prompt" not in body:
            raise APIError(400, "prompt is required", "prompt")
        request.prompt = _prompt(body["prompt"], vocab_size)
        echo = body.get("echo") or False
        if not isinstance(echo, bool):
            raise invalid("echo", "must be true or false")
        request.echo = echo
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, 1, 2**31, integer=True)
        if value is not None:
            request.max_tokens = value
            break
    if request.max_tokens is None and kind == "completion":
        request.max_tokens = 16  # OpenAI's default for completions
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", "must be true or false")
    request.stream = stream
    request.include_usage = _stream_options(body.get("stream_options"))
    # (low, high, integer, low bound excluded)
    limits = {"temperature": (0, 2, False, False), "top_p": (0, 1, False, True), "top_k": (-1, 2**31, True, False),
              "min_p": (0, 1, False, False), "repetition_penalty": (0, 10, False, True),
              "presence_penalty": (-2, 2, False, False), "frequency_penalty": (-2, 2, False, False),
              "seed": (*SEED_RANGE, True, False)}
    for name, (low, high, integer, low_open) in limits.items():
        value = _number(body, name, low, high, integer, low_open)
        if value is not None:
            request.sampling[name] = value
    if request.sampling.get("top_k") == -1:
        request.sampling["top_k"] = 0  # vLLM's "off"
    if "seed" in request.sampling:
        request.sampling["seed"] %= 2**63  # the engine's generators take non-negative seeds
    if logit_bias := _logit_bias(body.get("logit_bias"), vocab_size):
        request.sampling["logit_bias"] = logit_bias
    request.stop = _stops(body.get("stop"))
    request.n, request.logprobs = choices_field(body), logprobs_field(body, kind)
    try:
        request.constraint = constraint_options(body)
    except GrammarError as e:
        raise APIError(400, str(e), e.field, "invalid_constraint") from None
    return request


# stream_options' keys: include_usage is read; include_obfuscation pads OpenAI's events against
# side-channel attacks on their size, and lucebox sends no padding either way.
_STREAM_OPTIONS = ("include_usage", "include_obfuscation")


def _stream_options(options) -> bool:
    """Whether the stream ends with a usage event."""
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options", "must be an object like {\"include_usage\": true}")
    for key, value in options.items():
        if key not in _STREAM_OPTIONS:
            raise invalid(f"stream_options.{key}", f"is not served; stream_options takes {', '.join(_STREAM_OPTIONS)}")
        if not isinstance(value, bool):
            raise invalid(f"stream_options.{key}", "must be true or false")
    return options.get("include_usage", False)


def _prompt(value, vocab_size: int) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise invalid("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return value
    raise invalid("prompt", "must be a non-empty string or a list of token ids (one prompt per request)")


# -- responses --------------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(stats: dict) -> dict:
    prompt, generated = stats["prompt_tokens"], stats["generated_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": stats["cached_prompt_tokens"]}}


def completion(request: GenerationRequest, rid: str, model: str, text: str, finish: str, stats: dict) -> dict:
    created = int(time.time())
    if request.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": usage(stats)}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage(stats)}


def chunk(request: GenerationRequest, rid: str, model: str, text: str | None, finish: str | None,
          first: bool = False) -> dict:
    """One stream event: a piece of text, or (finish set) the closing one."""
    created = int(time.time())
    if request.kind == "chat":
        delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [choice]}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        event = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if request.include_usage:
        event["usage"] = None
    return event


def usage_chunk(request: GenerationRequest, rid: str, model: str, stats: dict) -> dict:
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(stats)}
