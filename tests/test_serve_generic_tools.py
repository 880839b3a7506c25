"""Tools through `lucebox serve` with no flags on the built-in model, whose chat template (none)
teaches no call syntax: every tool_choice answers with valid `tool_calls` in the generic JSON syntax
(stream and not), a model looping on its calls returns them once, and a tool-calling chat goes back
to the model as that syntax writes it."""

import json

import jsonschema
import pytest
from tool_models import SCHEMAS, TOOLS, streamed_answer

from lucebox.builtin import builtin_model
from lucebox.server.process import ServerProcess
from lucebox.text.tokenizer_files import load_tokenizer
from lucebox.tools import check_tools, prompt_parts

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_TOKEN = 493  # "to": the built-in vocabulary's first token of `{"tool_calls"` where `{"content"` differs
QUOTE = 4030  # '"': banned, the answer's JSON string never closes
MODEL = "laguna-code-6m"


@pytest.fixture(scope="module")
def client():
    s = ServerProcess()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    assert s.stop() == 0
    assert "Traceback" not in s.output()


@pytest.mark.parametrize("ask", [dict(tool_choice="required"), dict(tool_choice="required", parallel_tool_calls=False),
                                 dict(tool_choice={"type": "function", "function": {"name": "ping"}}),
                                 dict(logit_bias={TOOL_TOKEN: 100})])  # auto, steered to call
def test_each_tool_choice_returns_valid_calls_whole_and_streamed(client, ask):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           temperature=0, **ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if "tool_choice" in ask and isinstance(ask["tool_choice"], dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["ping"]
    if ask.get("parallel_tool_calls") is False:
        assert len(choice.message.tool_calls) == 1
    keys = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(set(keys)) == len(keys)  # a call the model repeats ends the answer: each comes back once
    streamed = streamed_answer(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0, stream=True, **ask))
    assert streamed == ("", keys, "tool_calls")  # greedy: the stream carries the whole answer's calls


def _closing_banned():
    """logit_bias that bans every token starting with "]": the list of calls never closes, so the model
    has to write calls until it repeats one (as a small model looping on its calls does)."""
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    return {i: -100 for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).startswith("]")}


def test_a_looping_model_returns_its_calls_once_and_a_cut_one_keeps_its_whole_calls(client):
    ask = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", logit_bias=_closing_banned())
    for sampling in (dict(temperature=0), dict(seed=3)):
        reply = client.chat.completions.create(max_tokens=600, **sampling, **ask)
        choice = reply.choices[0]  # without the stop at the repeat, it runs to max_tokens
        assert choice.finish_reason == "tool_calls" and reply.usage.completion_tokens < 300
        keys = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(set(keys)) == len(keys) >= (1 if "seed" not in sampling else 2)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed = streamed_answer(client.chat.completions.create(max_tokens=600, stream=True, **sampling, **ask))
        assert streamed == ("", keys, "tool_calls")
    inside = reply.usage.completion_tokens - 2  # inside the repeat: max_tokens cuts the last call in two
    cut = client.chat.completions.create(max_tokens=inside, seed=3, **ask)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == inside
    assert [(c.function.name, c.function.arguments) for c in cut.choices[0].message.tool_calls] == keys
    assert streamed_answer(client.chat.completions.create(max_tokens=inside, seed=3, stream=True, **ask)) == (
        "", keys, "length")


def test_an_auto_answer_is_the_answer_object_s_text_streamed_as_it_comes(client):
    for ask in (dict(temperature=0), dict(seed=1, logit_bias={QUOTE: -100})):  # a short answer; one cut in its text
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, **ask)
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and choice.finish_reason == ("stop" if "seed" not in ask else "length")
        assert choice.message.content and not choice.message.content.startswith("{")
        events = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60,
                                                     stream=True, **ask))
        assert streamed_answer(events) == (choice.message.content, [], choice.finish_reason)
    assert sum(1 for e in events if e.choices[0].delta.content) > 10  # in pieces as it comes, not at the end


def test_a_tool_calling_chat_goes_back_in_the_generic_syntax(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                                           tool_choice="required", parallel_tool_calls=False)
    [call] = reply.choices[0].message.tool_calls
    messages = [*MESSAGES, reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=30, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "tool_calls", "length")
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": {"host": "a.b"}}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "ping", "content": "up"},
        {"role": "tool", "tool_call_id": "c2", "content": "down"}]
    rendered, tools = prompt_parts(tokenizer, history, check_tools(TOOLS, "auto", None, None, lambda t: None, False))
    assert tools is None and rendered[0]["role"] == "system"
    assert '{"tool_calls": [{"name": NAME' in rendered[0]["content"]
    calls = '{"tool_calls": [{"name": "ping", "arguments": {"host": "a.b"}}]}'
    assert rendered[2] == {"role": "assistant", "content": calls}
    assert rendered[3]["role"] == "user" and len(rendered) == 4
    assert [json.loads(line)["content"] for line in rendered[3]["content"].splitlines()] == ["up", "down"]
