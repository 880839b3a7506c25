"""Type and range checks for public arguments: `LLM(...)`, `generate`/`stream`/`logits`,
`SamplingParams`, and through them every CLI flag. A failure is an InvalidArgumentError naming the
argument; nothing is coerced behind the caller's back (no bool taken for an int, no float
truncated to one, no NaN let through). config.json values have checks of their own
(`lucebox.models.hf_config`), which raise ConfigError and accept integral floats, as JSON writes them.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

from lucebox.errors import InvalidArgumentError

SEED_MAX = 2**63 - 1  # sampling seeds are 0..SEED_MAX
MAX_BIASED_TOKENS = 300  # a logit_bias's entries, at most (OpenAI's limit)
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 in effect bans a token, +100 in effect forces it
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_bool(value: Any) -> bool:
    """A bool, or a numpy/torch scalar of bool dtype (both convert to 0/1 silently otherwise)."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def _bounds(low, high, low_open: bool = False, high_open: bool = False, integral: bool = False) -> str:
    """'in 1..15' (integers), 'in (0, 1]' (numbers), '>= 1', '> 0'."""
    if low is not None and high is not None:
        if integral:
            return f"in {low}..{high}"
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"{'<' if high_open else '<='} {high}"


def integer(name: str, value: Any, low: int | None = None, high: int | None = None, *,
            optional: bool = False) -> int | None:
    """`value` as an int in low..high (a bound of None is open-ended); None passes with `optional`.
    Python, numpy and torch integers are accepted; bools and floats (even 4096.0) are not."""
    if value is None and optional:
        return None
    try:
        number = None if _is_bool(value) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise InvalidArgumentError(f"{name} must be an integer, got {_shown(value)}")
    if (low is not None and number < low) or (high is not None and number > high):
        raise InvalidArgumentError(f"{name} must be {_bounds(low, high, integral=True)}, got {number}")
    return number


def number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite float in the range; `low_open`/`high_open` leave the bound out."""
    try:
        as_float = None if _is_bool(value) or not isinstance(value, Real) else float(value)
    except OverflowError:
        as_float = None
    if as_float is None or not math.isfinite(as_float):
        raise InvalidArgumentError(f"{name} must be a finite number, got {_shown(value)}")
    below = low is not None and (as_float <= low if low_open else as_float < low)
    above = high is not None and (as_float >= high if high_open else as_float > high)
    if below or above:
        raise InvalidArgumentError(f"{name} must be {_bounds(low, high, low_open, high_open)}, got {value}")
    return as_float


def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """`value` when it is True or False (or None with `optional`); 0, 1 and "yes" are refused."""
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise InvalidArgumentError(f"{name} must be True or False{' or None' if optional else ''}, got {_shown(value)}")


def choice(name: str, value: Any, options: Sequence[str], *, optional: bool = False) -> str | None:
    """`value` when it is one of `options` (or None with `optional`)."""
    if (value is None and optional) or (isinstance(value, str) and value in options):
        return value
    raise InvalidArgumentError(f"{name} {_shown(value)} is not one of {', '.join(options)}")


def callback(name: str, value: Any) -> Callable | None:
    """A callable or None."""
    if value is None or callable(value):
        return value
    raise InvalidArgumentError(f"{name} must be a function or None, got {_shown(value)}")


def path(name: str, value: Any, *, optional: bool = False) -> str | os.PathLike | None:
    """A file system path (str or os.PathLike), or None with `optional`; one that holds a NUL character,
    which no file system accepts (the OS call would fail with a bare ValueError), is refused here."""
    if value is None and optional:
        return value
    if isinstance(value, (str, os.PathLike)):
        if "\x00" in os.fsdecode(value):
            raise InvalidArgumentError(f"{name} {_shown(os.fsdecode(value))} is not a file name: it holds a NUL "
                                       "character")
        return value
    raise InvalidArgumentError(f"{name} must be a path (str or pathlib.Path){' or None' if optional else ''}, "
                               f"got {_shown(value)}")


_BYTES = (bytes, bytearray, memoryview)


def token_id_list(name: str, value: Any, vocab_size: int) -> list[int]:
    """A sequence of token ids (a list, a tuple, a 1-D tensor, ...), each an integer in the vocabulary;
    not text and not bytes, whose items would pass for ids."""
    if isinstance(value, (str, *_BYTES)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a sequence of token ids (integers), got {_shown(value)}")
    ids = list(value)
    if not all(type(t) is int for t in ids):  # the common case costs one pass
        ids = [integer("token id", t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def token_biases(name: str, value: Any, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """A logit bias as ((token id, bias), ...) sorted by id, zeros left out, from None, a {token id: bias}
    mapping or such pairs: ids integers (in the vocabulary, when `vocab_size` is given), at most
    MAX_BIASED_TOKENS of them, biases finite numbers in BIAS_RANGE."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        pairs = list(value)
    else:
        raise InvalidArgumentError(f"{name} must be a mapping of token ids to biases, got {_shown(value)}")
    if len(pairs) > MAX_BIASED_TOKENS:
        raise InvalidArgumentError(f"{name} may bias at most {MAX_BIASED_TOKENS} tokens, got {len(pairs)}")
    biases = {}
    for token, bias in pairs:
        token = integer(f"{name} token id", token, 0, None if vocab_size is None else vocab_size - 1)
        biases[token] = number(f"{name}[{token}]", bias, *BIAS_RANGE)
    return tuple(sorted((t, b) for t, b in biases.items() if b != 0))


def stops(value: Any, vocab_size: int | None = None) -> tuple[list[str], set[int]]:
    """Stop strings and stop token ids from `stop`: None, a string, a token id, or a list of both; ids in
    the vocabulary, when `vocab_size` is given."""
    if value is None:
        return [], set()
    items = [value] if isinstance(value, (str, *_BYTES)) or not isinstance(value, Iterable) else value
    strings, ids = [], set()
    for item in items:
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, _BYTES):
            raise InvalidArgumentError(f"stop strings must be str, not bytes (got {_shown(item)}); decode them first")
        else:
            ids.add(integer("stop token id", item, 0, None if vocab_size is None else vocab_size - 1))
    return strings, ids


def size(name: str, text: Any) -> int:
    """Bytes from "24GiB", "24 GB", "512MiB" or a positive integer."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise InvalidArgumentError(f"{name} '{text}' is not a size; write it like 24GiB, 16GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
