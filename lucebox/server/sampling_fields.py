"""The request fields that become `RequestOptions`' max_tokens, sampling and stop, checked in OpenAI's
ranges by the engine's own argument checks (`lucebox.arguments`), each failure a 422 naming its field."""

from __future__ import annotations

from lucebox import arguments
from lucebox.errors import InvalidArgumentError
from lucebox.server.api_errors import APIError, invalid

MAX_STOPS = 4  # as OpenAI's API
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_TOKENS = 2**31  # the most a request may ask for; a chat that gives none asks for it, cut to the room left
SAMPLING_DEFAULTS = {"temperature": 1.0}  # OpenAI's, under the model's own defaults


def max_tokens_field(body: dict, kind: str) -> int:
    """`max_completion_tokens` (the newer name) or `max_tokens`, else the endpoint's default."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, 1, MAX_TOKENS, integer=True)
        if value is not None:
            return value
    return 16 if kind == "completion" else MAX_TOKENS  # OpenAI's default for completions; a chat's: the room left


def sampling_fields(body: dict, vocab_size: int) -> dict:
    """The SamplingParams fields the request gives."""
    sampling = {}
    # (low, high, integer, low bound excluded)
    limits = {"temperature": (0, 2, False, False), "top_p": (0, 1, False, True), "top_k": (-1, 2**31, True, False),
              "min_p": (0, 1, False, False), "repetition_penalty": (0, 10, False, True),
              "presence_penalty": (-2, 2, False, False), "frequency_penalty": (-2, 2, False, False),
              "seed": (*SEED_RANGE, True, False)}
    for name, (low, high, integer, low_open) in limits.items():
        value = _number(body, name, low, high, integer, low_open)
        if value is not None:
            sampling[name] = value
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0  # vLLM's "off"
    if "seed" in sampling:
        sampling["seed"] %= 2**63  # the engine's generators take non-negative seeds
    if logit_bias := _logit_bias(body.get("logit_bias"), vocab_size):
        sampling["logit_bias"] = logit_bias
    return sampling


def stop_field(value) -> list[str]:
    """Stop strings: one, or a list of up to MAX_STOPS, none empty."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return stops


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
