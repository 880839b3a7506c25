"""A chat session's per-turn settings (`RequestOptions`' fields, as `LLM.stream`'s keywords): their
defaults, the model's own (generation_config.json), and the one check every way of setting them goes
through (`LLM.chat`'s keywords, `/set`, a loaded chat file)."""

from __future__ import annotations

from lucebox.constrained import constraint_from
from lucebox.constrained.spec import refuse_stops
from lucebox.errors import InvalidArgumentError
from lucebox.request_options import RequestOptions

PLAIN_STOP = ["\n\n\n"]
# Per-turn settings a session keeps, with their defaults (`LLM.stream`'s keywords).
DEFAULTS = {"max_tokens": 256, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "repetition_penalty": 1.0, "seed": None, "stop": None,
            "json_schema": None, "grammar": None, "json_object": False}  # constrained answers (`LLM.stream`)


def model_defaults(generation_config: dict) -> dict:
    """The sampling defaults a model folder's generation_config.json asks for (as vLLM serves them):
    its temperature, top_p, ... when `do_sample` is true; greedy otherwise."""
    if generation_config.get("do_sample") is not True:
        return {}
    keys = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}
    found = {k: kind(generation_config[k]) for k, kind in keys.items()
             if isinstance(generation_config.get(k), (int, float)) and not isinstance(generation_config[k], bool)}
    try:
        check_settings({**DEFAULTS, **found})
    except InvalidArgumentError:
        return {}  # a broken generation_config.json leaves the plain defaults
    return found


def check_settings(settings: dict) -> None:
    """Settings valid for `LLM.stream`, or an InvalidArgumentError naming the bad one."""
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise InvalidArgumentError(f"unknown chat setting {unknown[0]!r}; settings are {', '.join(DEFAULTS)}")
    # every field as a request checks it; the stop list by the chat's own, stricter rule below
    RequestOptions.from_keywords(**{**settings, "stop": None})
    constraint_from(settings["json_schema"], settings["grammar"], settings["json_object"])  # compiled: refused now
    stop = settings["stop"]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise InvalidArgumentError(f"stop must be a list of non-empty strings or None, got {stop!r}")
    if makes_json(settings):
        refuse_stops(own_stops(stop), "json_schema or json_object", settings["json_schema"] or {"type": "object"})


def makes_json(settings: dict) -> bool:
    return settings["json_schema"] is not None or settings["json_object"] is True


def own_stops(stop: list[str] | None) -> list[str]:
    """The stop strings besides the plain template's default (which JSON output goes without: its end is
    the grammar's)."""
    return [s for s in stop or [] if s not in PLAIN_STOP]
