"""One checked `RequestOptions` per request, whoever builds it: `LLM.stream`'s keywords, a
`RequestOptions` given whole, a chat's settings and an OpenAI request body ask the engine for the
same thing when they say the same thing."""

import dataclasses

import pytest

from lucebox import RequestOptions, SamplingParams
from lucebox.chat.settings import model_defaults
from lucebox.errors import GrammarError, InvalidArgumentError
from lucebox.server.openai_api import parse_request

PROMPT = "def merge(left, right):\n"


def test_request_options_are_frozen_and_normalized():
    options = RequestOptions(max_tokens=8, stop=["\n\n", 7, "#", 3], snapshot_at=[4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_tokens = 9
    assert options.stop == ("\n\n", "#", 3, 7) and options.snapshot_at == (4,)
    assert (options.stop_strings, options.stop_ids) == (("\n\n", "#"), frozenset({3, 7}))
    assert RequestOptions(max_tokens=8, stop="x") == RequestOptions(max_tokens=8, stop=["x"])
    assert RequestOptions.from_keywords(max_tokens=8, temperature=0.5, logit_bias={3: 1}) == RequestOptions(
        max_tokens=8, sampling=SamplingParams(temperature=0.5, logit_bias=((3, 1.0),)))


@pytest.mark.parametrize("keywords, error, message", [
    ({"max_tokens": 0}, InvalidArgumentError, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 4.0}, InvalidArgumentError, "max_tokens must be an integer"),
    ({"temperature": -1.0}, InvalidArgumentError, "temperature must be >= 0"),
    ({"logprobs": 21}, InvalidArgumentError, r"logprobs must be in 0\.\.20, got 21"),
    ({"ignore_eos": "yes"}, InvalidArgumentError, "ignore_eos must be True or False"),
    ({"speculate": 0}, InvalidArgumentError, "speculate must be True or False"),
    ({"stop": b"\n"}, InvalidArgumentError, "stop strings must be str, not bytes"),
    ({"stop": [5000]}, InvalidArgumentError, r"stop token id must be in 0\.\.4095, got 5000"),
    ({"logit_bias": {-1: 1.0}}, InvalidArgumentError, r"logit_bias token id must be in 0\.\.4095, got -1"),
    ({"snapshot_at": "3"}, InvalidArgumentError, "snapshot_at is a list of prompt positions"),
    ({"json_object": "yes"}, GrammarError, "json_object: must be True or False"),
    ({"json_object": True, "grammar": 'start: "a"'}, GrammarError, "json_object: give one of"),
    ({"json_object": True, "ignore_eos": True}, GrammarError, "json_object: a constrained output ends with EOS"),
])
def test_a_bad_option_is_the_typed_error_naming_it_however_it_is_given(builtin_llm, keywords, error, message):
    with pytest.raises(error, match=message):
        builtin_llm.stream(PROMPT, **{"max_tokens": 4, **keywords})
    with pytest.raises(error, match=message):  # as the server builds them: the vocabulary known
        RequestOptions.from_keywords(builtin_llm.config.vocab_size, **{"max_tokens": 4, **keywords})


def test_options_given_whole_decode_the_tokens_of_their_keywords(builtin_llm):
    for keywords in ({"max_tokens": 24, "ignore_eos": True},
                     {"max_tokens": 24, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95, "seed": 7}):
        options = RequestOptions.from_keywords(**keywords)
        by_keywords = builtin_llm.generate(PROMPT, **keywords).token_ids
        assert builtin_llm.generate(PROMPT, options).token_ids == by_keywords
        assert [t for c in builtin_llm.stream(PROMPT, options) for t in c.token_ids] == by_keywords
    with pytest.raises(InvalidArgumentError, match="RequestOptions or its fields"):
        builtin_llm.generate(PROMPT, options, max_tokens=4)
    for outside in ({"stop": [5000]}, {"sampling": SamplingParams(logit_bias={5000: 1.0})}):  # no vocabulary yet
        with pytest.raises(InvalidArgumentError, match=r"token id must be in 0\.\.4095, got 5000"):
            builtin_llm.stream(PROMPT, RequestOptions(max_tokens=4, **outside))


def test_a_request_body_gives_the_options_of_the_same_keywords():
    body = {"prompt": "x", "max_tokens": 12, "top_p": 0.5, "seed": 3, "stop": ["\n\n", "#"], "logprobs": 2,
            "logit_bias": {"5": -100}, "grammar": 'start: "yes" | "no"'}
    got = parse_request(body, "completion", 4096, {"top_k": 40, "top_p": 0.9}).options  # the model's, under the body's
    assert got == RequestOptions.from_keywords(4096, max_tokens=12, temperature=1.0, top_k=40, top_p=0.5, seed=3,
                                               stop=["\n\n", "#"], logprobs=2, logit_bias={5: -100},
                                               grammar='start: "yes" | "no"')
    json_mode = {"prompt": [1, 2], "response_format": {"type": "json_object"}, "top_k": -1}
    assert parse_request(json_mode, "completion", 4096).options == RequestOptions.from_keywords(
        max_tokens=16, temperature=1.0, json_object=True)  # OpenAI's defaults; top_k -1 is off, as 0
    chat = parse_request({"messages": [{"role": "user", "content": "x"}], "temperature": 0, "stop": "#"}, "chat", 4096)
    assert chat.options == RequestOptions(max_tokens=2**31, stop=["#"])  # max_tokens: cut to the room left later


def test_a_chat_turn_runs_the_options_of_its_settings(builtin_llm, monkeypatch):
    ran = []
    stream = builtin_llm.stream
    monkeypatch.setattr(builtin_llm, "stream", lambda prompt, options: ran.append(options) or stream(prompt, options))
    chat = builtin_llm.chat(temperature=0.7, seed=5, max_tokens=6)
    chat.send("def f(x):", top_k=3)
    (options,) = ran
    model = model_defaults(builtin_llm.description.generation_config)  # top_p, repetition_penalty
    assert options == RequestOptions.from_keywords(**{**model, "temperature": 0.7}, max_tokens=6, seed=5, top_k=3,
                                                   stop=["\n\n\n"], snapshot_at=options.snapshot_at)  # the turn's
    builtin_llm.drop_cache()
