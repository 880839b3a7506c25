"""What a request asks of the engine beside its prompt: `RequestOptions`, one frozen value checked here
however it is built: from `LLM.stream`'s keywords (`RequestOptions.from_keywords`), from a chat's settings
(`lucebox.chat`), from an OpenAI request (`lucebox.server.openai_api.parse_request`). What needs the
model is checked when the request opens (`LLM.stream`): token ids against its vocabulary, `max_tokens`
against the context the prompt leaves, `snapshot_at` against the prompt, and the constraint compiled
(`lucebox.constrained`). Plain data: nothing here imports the engine or the grammar engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from lucebox.arguments import flag, integer, stops, token_biases
from lucebox.errors import GrammarError, InvalidArgumentError
from lucebox.logprobs import MAX_TOP_LOGPROBS
from lucebox.sampling import SamplingParams
from lucebox.text.reasoning import FORMATS as THOUGHT_FORMATS
from lucebox.text.tool_calls import FORMATS

# `LLM.stream`'s keywords that are SamplingParams' fields (the others are RequestOptions' own)
SAMPLING_KEYWORDS = tuple(f.name for f in fields(SamplingParams) if not f.name.startswith("_"))


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """One request's options; `LLM.stream(prompt, options)` runs them, and its keywords build one.

    `max_tokens`: the most tokens to generate. `sampling`: a `SamplingParams` (greedy by default).
    Its `presence_penalty`, `frequency_penalty` (-2..2, OpenAI's): each token's logit is lowered by
    count * frequency_penalty + (count > 0) * presence_penalty, count = the times this completion has
    generated it so far (the prompt is not counted). Its `logit_bias` ({token id: bias}, OpenAI's): each
    bias (-100..100; at most 300 tokens) is added to its token's logit before the penalties and
    everything else (-100 in effect bans the token, 100 in effect forces it); speculation stays lossless
    with it, and logprobs stay the raw ones. Its `seed` makes a sampled output reproducible: the same
    seed and request give the same tokens, whatever the cache held before.
    `stop` holds stop strings (never emitted) and/or stop token ids (emitted, like EOS): one string, one
    id or a sequence, kept as the strings in order, then the ids sorted. `ignore_eos`: go on past EOS.
    `speculate=False` decodes this request without the engine's drafter (to compare the two on one set
    of weights): greedy output is the same token for token, sampled output has the same distribution
    (the draws differ).
    `snapshot_at`: prompt positions (a chat's turn boundary: where the template's generation prompt
    starts) whose states a hybrid model's recurrent layers keep, so that a later prompt sharing only
    that prefix prefills from there (the prompt's second-to-last position is always kept; attention
    layers return to any prefix without help).
    Constrained output (at most one; `lucebox.constrained`): `json_schema` (a JSON Schema, as a dict or
    JSON text), `json_object=True` (any JSON object) or `grammar` (Lark, llguidance's syntax, or
    llama.cpp's GBNF). Every token is chosen from the tokens the grammar allows (with or without
    speculation), and the output ends with EOS once the grammar is complete; `max_tokens` can still cut
    it short (finish_reason "length"). Stats then add `grammar_masks` (rows masked) and
    `grammar_mask_time_s` (host time computing them).
    `logprobs=k` (0..20): every chunk carries `logprobs`, one `lucebox.logprobs.TokenLogprob` per
    token: its log-probability and the k likeliest tokens' under the model's raw logits (before
    penalties, temperature, truncation and grammar), equal to log_softmax(`LLM.logits`) at its position.
    `end_on_repeated_call`: a tool-call syntax (`lucebox.text.tool_calls.FORMATS`): the answer ends
    (finish_reason "stop") at the token that completes a call it already wrote, same name and same
    arguments (a model looping on its calls; `lucebox.text.call_watch`). `thought_syntax` (a reasoning
    model's, `lucebox.text.reasoning.FORMATS`) and `starts_in_thought` (the prompt opened the thought):
    calls are looked for in the answer after its thought only. `thought_budget` (with a `<think>`
    `thought_syntax`): after that many tokens of thought the close is forced and the model answers
    (`lucebox.text.thought_budget`); freely, or under `after_thought` (Lark: the close, then the
    answer's constraint; `constrained.thought_first.thought_close_grammar`), which a constrained
    request needs (its `grammar` then lets the thought come first: `thought_first_grammar`).
    """

    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str | int, ...] = ()
    ignore_eos: bool = False
    speculate: bool = True
    snapshot_at: tuple[int, ...] = ()
    json_schema: dict | str | None = None
    grammar: str | None = None
    json_object: bool = False
    logprobs: int | None = None
    end_on_repeated_call: str | None = None
    thought_syntax: str | None = None
    starts_in_thought: bool = False
    thought_budget: int | None = None
    after_thought: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgumentError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        checked = {
            "logprobs": integer("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS, optional=True),
            "max_tokens": integer("max_tokens", self.max_tokens, 1),
            "ignore_eos": flag("ignore_eos", self.ignore_eos),
            "speculate": flag("speculate", self.speculate),
            "stop": _stop_tuple(self.stop, None),
            "snapshot_at": _positions(self.snapshot_at),
        }
        if self.end_on_repeated_call is not None and self.end_on_repeated_call not in FORMATS:
            raise InvalidArgumentError(f"end_on_repeated_call must be one of {', '.join(FORMATS)} or None, "
                                       f"got {self.end_on_repeated_call!r}")
        if self.thought_syntax is not None and self.thought_syntax not in THOUGHT_FORMATS:
            raise InvalidArgumentError(f"thought_syntax must be one of {', '.join(THOUGHT_FORMATS)} or None, "
                                       f"got {self.thought_syntax!r}")
        flag("starts_in_thought", self.starts_in_thought)
        integer("thought_budget", self.thought_budget, 1, optional=True)
        constraint = chosen_constraint(self.json_schema, self.grammar, self.json_object)
        if self.thought_budget is not None and self.thought_syntax != "think":
            raise InvalidArgumentError("thought_budget needs thought_syntax 'think'")
        if self.after_thought is not None and not isinstance(self.after_thought, str):
            raise InvalidArgumentError(f"after_thought must be Lark text, got {type(self.after_thought).__name__}")
        if self.thought_budget is not None and constraint is not None and (
                constraint != "grammar" or self.after_thought is None):
            raise InvalidArgumentError("a bounded thought before a constrained answer needs the answer's constraint "
                                       "as a grammar that lets the thought come first, and after_thought: the close "
                                       "and that constraint (constrained.thought_first builds both)")
        if self.after_thought is not None and self.thought_budget is None:
            raise InvalidArgumentError("after_thought is what a spent thought_budget forces; give thought_budget too")
        if constraint is not None and checked["ignore_eos"]:
            raise GrammarError(constraint, "a constrained output ends with EOS; it cannot take ignore_eos=True")
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: normalized in __post_init__, as SamplingParams does

    @classmethod
    def from_keywords(cls, vocab_size: int | None = None, **keywords) -> RequestOptions:
        """The options `LLM.stream`'s keywords ask for: RequestOptions' fields besides `sampling`, and
        SamplingParams' fields. With `vocab_size`, token ids (`logit_bias`, `stop`) are checked against the
        vocabulary first, so that an error gives its range."""
        sampling = {name: keywords.pop(name) for name in SAMPLING_KEYWORDS if name in keywords}
        if vocab_size is not None:
            sampling["logit_bias"] = token_biases("logit_bias", sampling.get("logit_bias"), vocab_size)
        params = SamplingParams(**sampling)
        if vocab_size is not None and "stop" in keywords:
            keywords["stop"] = _stop_tuple(keywords["stop"], vocab_size)
        return cls(sampling=params, **keywords)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop if isinstance(s, str))

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(s for s in self.stop if not isinstance(s, str))

    @property
    def makes_json(self) -> bool:
        """Whether the output is constrained to JSON (which a stop string could cut)."""
        return self.json_schema is not None or self.json_object

    def check_token_ids(self, vocab_size: int) -> None:
        """An InvalidArgumentError naming the first token id (of `logit_bias`, of `stop`) outside the vocabulary."""
        token_biases("logit_bias", self.sampling.logit_bias, vocab_size)
        _stop_tuple(self.stop, vocab_size)


def chosen_constraint(json_schema=None, grammar=None, json_object=False) -> str | None:
    """The constraint keyword given (`json_schema`, `grammar` or `json_object`), or None; a GrammarError
    naming the second when more than one is."""
    if not isinstance(json_object, bool):
        raise GrammarError("json_object", f"must be True or False, got {json_object!r}")
    given = [name for name, value in (("json_schema", json_schema), ("grammar", grammar),
                                      ("json_object", json_object or None)) if value is not None]
    if len(given) > 1:
        raise GrammarError(given[1], f"give one of json_schema, grammar, json_object, not {' and '.join(given)}")
    return given[0] if given else None


def _stop_tuple(value, vocab_size: int | None) -> tuple[str | int, ...]:
    strings, ids = stops(value, vocab_size)
    return (*strings, *sorted(ids))


def _positions(value) -> tuple[int, ...]:
    """Prompt positions as integers; their range is the prompt's, checked when the request opens."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgumentError(f"snapshot_at is a list of prompt positions, got {type(value).__name__}")
    return tuple(integer("snapshot_at", p) for p in value)
