"""Tool calling through `lucebox serve` and the official `openai` client, on a model whose chat
template teaches Qwen 2.5's `<tool_call>` syntax (tests/tool_models.py)."""

import json

import jsonschema
import pytest
from tool_models import AUTO_CALL, MALFORMED, QWEN_TOOLS_TEMPLATE, SCHEMAS, TOOLS, streamed_answer

from lucebox.chat.conversation import render
from lucebox.cli import build_parser
from lucebox.server.command import settings_from
from lucebox.server.openai_api import APIError, parse_request
from lucebox.server.tools import tool_request
from lucebox.text.tokenizer_files import load_tokenizer
from lucebox.tools import model_tool_format, prompt_parts

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(tools_server):
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="none", max_retries=0)


def test_required_and_a_named_function_return_calls_whose_arguments_follow_the_schema(tools_server):
    client = _client(tools_server)
    asks = [dict(tool_choice="required", parallel_tool_calls=False, temperature=0),
            dict(tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5),
            dict(tool_choice={"type": "function", "function": {"name": "ping"}}, temperature=1.0, seed=2),
            dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0, seed=3)]
    for ask in asks:
        reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=64, **ask)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(ask["tool_choice"], dict):
            assert call.function.name == ask["tool_choice"]["function"]["name"]
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        content, calls, finish = streamed_answer(client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=64, stream=True, **ask))
        assert (content, finish) == ("", "tool_calls")
        if ask.get("temperature") == 0 or "seed" in ask:  # the same draws: the same call as the whole answer
            assert calls == [(call.function.name, call.function.arguments)]



def test_auto_parses_the_model_s_calls_and_gives_a_malformed_or_off_schema_strict_call_back_as_text(tools_server):
    client = _client(tools_server)
    expected = [("get_weather", {"city": "Oslo", "days": 2}), ("ping", {"host": "a.b"})]
    reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=96,
                                           extra_body={"grammar": AUTO_CALL})
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Checking.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected
    content, calls, finish = streamed_answer(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=96, stream=True, extra_body={"grammar": AUTO_CALL}))
    assert (content, finish) == ("Checking.\n", "tool_calls")
    assert [(name, json.loads(arguments)) for name, arguments in calls] == expected
    text = MALFORMED.split('"', 1)[1][:-1].encode().decode("unicode_escape")
    for stream in (False, True):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=96,
                                               stream=stream, extra_body={"grammar": MALFORMED})
        content, calls, finish = streamed_answer(reply) if stream else (
            reply.choices[0].message.content, reply.choices[0].message.tool_calls or [], reply.choices[0].finish_reason)
        assert (content, calls, finish) == (text, [], "stop")
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    off_schema = AUTO_CALL.replace("Oslo", "Lima")  # not one of the cities get_weather takes
    for tools, grammar, called in ((strict, AUTO_CALL, True), (strict, off_schema, False), (TOOLS, off_schema, True)):
        reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=tools, max_tokens=96,
                                               extra_body={"grammar": grammar}).choices[0]
        assert (reply.message.tool_calls is not None, reply.finish_reason == "tool_calls") == (called, called)
    plain = 'start: " Sure, no call needed."'  # a leading space: sentencepiece writes it only after context
    answers = [client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              max_tokens=32, extra_body={"grammar": plain}).choices[0].message.content
               for choice in ("auto", "none")]  # parsed from our own decoding, and the engine's text
    assert answers == [" Sure, no call needed."] * 2
    none = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=96, extra_body={"grammar": AUTO_CALL}).choices[0]
    assert none.message.tool_calls is None and none.message.content.startswith("Checking.\n<tool_call>")


def test_a_tool_calling_chat_goes_back_through_the_template(tools_server, tools_model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 3}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    reply = _client(tools_server).chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    tokenizer = load_tokenizer(tools_model, {}, None)
    request = parse_request({"messages": messages, "tools": TOOLS}, "chat", 10**6)
    request.tools = tool_request({"tools": TOOLS}, "chat", "hermes", lambda text: None, False)
    prompt = render(tokenizer, *prompt_parts(tokenizer, request.messages, request.tools)[:1], True,
                    request.tools.tools)
    assert json.dumps(TOOLS[1]) in prompt  # the tools, as the template writes them
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    as_transformers_takes = [*messages[:1], {**messages[1], "tool_calls": [{**call, "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}, messages[2]]
    assert prompt == reference.apply_chat_template(as_transformers_takes, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=True, chat_template=QWEN_TOOLS_TEMPLATE)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in prompt
    assert prompt.endswith('<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    builtin = load_tokenizer(__import__("lucebox.builtin").builtin.builtin_model(), {}, None)  # no chat template
    plain, tools = prompt_parts(builtin, MESSAGES, request.tools)
    assert tools is None and plain[0]["role"] == "system" and '"name": "ping"' in plain[0]["content"]


def _refused(tools_server, body, path="/v1/chat/completions"):
    prompt = {"messages": MESSAGES} if path.endswith("chat/completions") else {}
    code, reply, _ = tools_server.post(path, json.dumps({**prompt, "max_tokens": 4, **body}).encode())
    return code, reply["error"]["param"]


def test_bad_tool_requests_are_refused_naming_the_field_and_nothing_reaches_the_engine(tools_server):
    def tool(**function):
        return {"type": "function", "function": {"name": "f", **function}}

    cases = [
        ({"tools": [tool(parameters={"type": "strnig"})]}, 400, "tools[0].function.parameters"),
        ({"tools": [tool(parameters=["not", "a", "schema"])]}, 422, "tools[0].function.parameters"),
        ({"tools": [tool(name="no spaces allowed")]}, 422, "tools[0].function.name"),
        ({"tools": [tool(), tool()]}, 400, "tools[1].function.name"),
        ({"tools": [tool(parametrs={})]}, 422, "tools[0].function.parametrs"),
        ({"tools": [{"type": "retrieval"}]}, 422, "tools[0]"),
        ({"tools": "f"}, 422, "tools"),
        ({"tools": [tool(strict="yes")]}, 422, "tools[0].function.strict"),
        ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
        ({"tools": [tool()], "tool_choice": "sometimes"}, 422, "tool_choice"),
        ({"tools": [tool()], "tool_choice": {"type": "function", "function": "f"}}, 422, "tool_choice"),
        ({"tools": [tool(parameters='{"type": "object"}')]}, 422, "tools[0].function.parameters"),  # JSON text
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"tools": [tool()], "parallel_tool_calls": "yes"}, 422, "parallel_tool_calls"),
        ({"tools": [tool()], "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
         "tool_choice"),
        ({"functions": [{"name": "f"}]}, 422, "functions"),
        ({"messages": [*MESSAGES, {"role": "tool", "content": "21"}]}, 422, "messages[1].tool_call_id"),
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}]}, 422,
         "messages[1].tool_calls[0].function.arguments"),
    ]
    before = tools_server.metric("requests_total")
    for body, status, param in cases:
        assert _refused(tools_server, body) == (status, param), body
    assert _refused(tools_server, {"prompt": "x", "tools": [tool()]}, "/v1/completions") == (422, "tools")
    assert tools_server.metric("requests_total") == before


def test_the_call_syntax_comes_from_the_template_or_the_flag_and_a_model_with_none_gets_the_generic_one(
        tools_model):
    class Model:
        tokenizer = load_tokenizer(tools_model, {}, None)

    assert model_tool_format(Model, None) == ("hermes", False)
    flag = settings_from(build_parser().parse_args(["serve", "--tool-parser", "mistral"])).tool_parser
    assert model_tool_format(Model, flag) == ("mistral", False)
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["serve", "--tool-parser", "qwen"])
    generic = tool_request({"tools": TOOLS}, "chat", None, lambda text: None, False)
    assert generic.fmt == "json" and "grammar" in generic.constraint  # auto too: the grammar forces the syntax
    with pytest.raises(APIError) as refused:  # which then cannot take another constraint
        tool_request({"tools": TOOLS, "response_format": {"type": "json_object"}}, "chat", None, lambda t: None, False)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    unparsed = tool_request({"tools": TOOLS, "tool_choice": "none"}, "chat", None, lambda text: None, False)
    assert unparsed.choice == "none"  # the tools are rendered, nothing is parsed: no syntax needed


def test_tools_with_n_choices_and_logprobs_parse_each_choice_and_cover_every_token(tools_server):
    client, named = _client(tools_server), {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=named, n=3,
                                           temperature=1.0, seed=4, max_tokens=64, logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        [call] = choice.message.tool_calls
        assert (choice.finish_reason, call.function.name) == ("tool_calls", "get_weather")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert len({c.message.tool_calls[0].function.arguments for c in reply.choices}) > 1  # each its own draws
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    events = list(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, max_tokens=96, n=2, stream=True, logprobs=True,
        extra_body={"grammar": AUTO_CALL}, stream_options={"include_usage": True}))
    for index in (0, 1):
        content, calls, finish = streamed_answer(e for e in events if e.choices and e.choices[0].index == index)
        assert (content, finish, [name for name, _ in calls]) == ("Checking.\n", "tool_calls", ["get_weather", "ping"])
    tokens = sum(len(e.choices[0].logprobs.content) for e in events if e.choices and e.choices[0].logprobs)
    assert tokens == events[-1].usage.completion_tokens
