"""`n` choices for one request: the engine runs the request n times, one after another, each
reusing the prompt's rows the one before left in the session's cache (so a second choice prefills
one token). Choice 0 runs with the request's seed; choice i > 0 with a seed derived from it, so
choices differ but repeat across requests. Usage counts the prompt once and sums the choices'
completion tokens. Streamed, each event names its choice's `index`; the choices come in turn.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from lucebox.arguments import SEED_MAX
from lucebox.request_options import RequestOptions
from lucebox.server.api_errors import invalid

MAX_CHOICES = 16  # each choice is a whole generation: more would hold the one engine for long


def choices_field(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"must be an integer in 1..{MAX_CHOICES} (choices run one after another), got {n!r}")
    return n


def choice_options(options: RequestOptions, index: int) -> RequestOptions:
    """The options of choice `index`: a seeded request's choice i > 0 gets a seed of its own."""
    seed = options.sampling.seed
    if index == 0 or seed is None:
        return options
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    own_seed = int.from_bytes(digest[:8], "little") % (SEED_MAX + 1)
    return replace(options, sampling=replace(options.sampling, seed=own_seed))


def total_stats(stats: list[dict]) -> dict:
    """The figures `openai_api.usage` reads, for all the choices: the prompt once, the tokens summed."""
    return {**stats[0], "generated_tokens": sum(s["generated_tokens"] for s in stats)}


class Answer:
    """One choice as its chunks add up: text, token ids, logprobs, and (from its last chunk) finish and stats."""

    def __init__(self):
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # `lucebox.logprobs.TokenLogprob`s, when the request asked
        self.finish_reason: str | None = None
        self.stats: dict | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, chunk) -> None:
        self.texts.append(chunk.text or "")
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs or [])
        if chunk.finish_reason is not None:  # a choice's last chunk: the next one starts the next choice
            self.finish_reason, self.stats = chunk.finish_reason, chunk.stats


def numbered(bodies: list[dict], usage: dict) -> dict:
    """One response from the responses built for each choice alone (each as choice 0)."""
    body = bodies[0]
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    body["usage"] = usage
    return body
