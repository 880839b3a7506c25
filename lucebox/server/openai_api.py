"""The OpenAI API's request and response shapes: requests checked field by field into the
`RequestOptions` `LLM.stream` takes (errors in OpenAI's JSON: `api_errors`), and the completion objects
and stream chunks."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from lucebox.errors import GrammarError, InvalidArgumentError
from lucebox.request_options import RequestOptions
from lucebox.sampling import SamplingParams
from lucebox.server.api_errors import APIError, invalid, mid_output_error
from lucebox.server.choices import choices_field
from lucebox.server.logprobs_format import logprobs_field
from lucebox.server.request_fields import check_fields
from lucebox.server.sampling_fields import SAMPLING_DEFAULTS, max_tokens_field, sampling_fields, stop_field
from lucebox.server.structured import constraint_options
from lucebox.server.tools import tool_message

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenerationRequest:
    """One completion request, checked: the prompt (messages or text or ids) and `LLM.stream` options."""

    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    echo_text: str = ""  # what an echo puts before the answer: the prompt, as text (`app`)
    n: int = 1  # choices (`server.choices`)
    # `LLM.stream`'s options as the body asks (`app` adds what the prompt decides: the room left, snapshot_at)
    options: RequestOptions | None = None
    tools: object = None  # a `lucebox.tools.ToolRequest`, or None


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
        thought = m.get("reasoning_content")
        if role == "assistant" and thought is not None:  # an answer's thought, for a template that renders it
            if not isinstance(thought, str):
                raise invalid(f"messages[{i}].reasoning_content", "must be a string")
            messages[-1]["reasoning_content"] = thought
    return messages


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


def parse_request(body, kind: str, vocab_size: int, model_defaults: dict | None = None) -> GenerationRequest:
    """A checked request from a decoded JSON body (`kind`: "chat" or "completion"); `model_defaults`: the
    sampling fields of the model's generation_config.json (`chat.settings.model_defaults`), for those the
    request leaves out."""
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
    max_tokens = max_tokens_field(body, kind)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid("stream", "must be true or false")
    request.stream = stream
    request.include_usage = _stream_options(body.get("stream_options"))
    sampling = {**SAMPLING_DEFAULTS, **(model_defaults or {}), **sampling_fields(body, vocab_size)}
    stop = stop_field(body.get("stop"))
    request.n, logprobs = choices_field(body), logprobs_field(body, kind)
    try:
        constraint = constraint_options(body)
    except GrammarError as e:
        raise APIError(400, str(e), e.field, "invalid_constraint") from None
    try:
        request.options = RequestOptions(max_tokens=max_tokens, sampling=SamplingParams(**sampling), stop=stop,
                                         logprobs=logprobs, **constraint)
    except InvalidArgumentError as e:  # what passes the API's ranges but not the engine's (a temperature of 1e-6)
        raise mid_output_error(e, request) from None
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
