"""Tools on any model: the generic JSON syntax (`lucebox.text.json_calls`) for a model whose template
teaches none, forced by the grammar under every tool_choice; an answer cut short keeps the calls it
wrote whole; a model looping on its calls stops at the first repeat (`text.call_watch`, the engine's
text stage) and returns each call once."""

import json

import jsonschema
import pytest
from tool_models import SCHEMAS, TOOLS

from lucebox.builtin import builtin_model
from lucebox.constrained.tool_grammar import tool_call_grammar
from lucebox.engine.text_stage import TextStage
from lucebox.text.json_calls import answer_text, string_prefix
from lucebox.text.tokenizer_files import load_tokenizer
from lucebox.text.tool_calls import complete_calls, first_repeat, parse_tool_calls
from lucebox.tools import ToolCallStream, check_tools, prompt_parts

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
PING = '{"name": "ping", "arguments": {"host": "a.b"}}'


class _CharTokenizer:
    """Token i is the text's character i (-1: an end token that decodes to nothing)."""

    def __init__(self, text):
        self.text = text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.text[i] for i in ids if i >= 0)


def _pairs(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_a_json_string_decodes_as_far_as_its_escapes_are_whole():
    body = 'a\\"b\\\\c\\n\\u00e9\\ud83d\\ude00"}'
    assert string_prefix(body) == 'a"b\\c\né\U0001F600'
    for cut, decoded in [(2, "a"), (3, 'a"'), (13, 'a"b\\c\n'), (15, 'a"b\\c\né'), (21, 'a"b\\c\né'),
                         (26, 'a"b\\c\né'), (27, 'a"b\\c\né\U0001F600')]:
        assert string_prefix(body[:cut]) == decoded, cut
    assert answer_text('{"content": "hi') == "hi" and answer_text('{"tool_calls": [') is None


def test_the_generic_syntax_reads_calls_or_an_answer_and_anything_else_is_text():
    parsed = parse_tool_calls('{"tool_calls": [' + WEATHER + ", " + PING + "]}", "json")
    assert _pairs(parsed) == [("get_weather", {"city": "Paris", "days": 3}), ("ping", {"host": "a.b"})]
    assert parse_tool_calls('{"content": "It is \\"sunny\\"."}', "json") == parse_tool_calls("x", "json").__class__(
        'It is "sunny".', ())
    assert parse_tool_calls('{"content": "cut sho', "json").content == "cut sho"  # max_tokens inside the answer
    for text in ('{"tool_calls": []}', '{"other": 1}', "plain words", '{"tool_calls": [{"name": 3}]}'):
        assert parse_tool_calls(text, "json") == parse_tool_calls(text, "json").__class__(text, ()), text


@pytest.mark.parametrize("fmt, text", [
    ("json", '{"tool_calls": [' + WEATHER + ", " + PING + ', {"name": "ping", "argu'),
    ("hermes", f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{PING}\n</tool_call>\n<tool_call>\n{{"),
    ("llama3", WEATHER.replace("arguments", "parameters") + "; " + PING.replace("arguments", "parameters") + '; {"na'),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {PING}, {{\"name\""),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]ping[ARGS]{"host": "a.b"}'
                "[TOOL_CALLS]ping[ARGS]{"),
])
def test_an_answer_cut_short_keeps_the_calls_it_wrote_whole_in_each_syntax(fmt, text):
    assert parse_tool_calls(text, fmt).calls == ()  # as a whole answer it does not parse
    assert _pairs(complete_calls(text, fmt)) == [("get_weather", {"city": "Paris", "days": 3}),
                                                 ("ping", {"host": "a.b"})]
    assert complete_calls(text[:5], fmt).calls == ()


def _stream(text, cuts, finish="stop", choice="auto"):
    request = check_tools(TOOLS, choice, None, None, lambda t: None, False)
    calls = ToolCallStream(_CharTokenizer(text), request, [-1], [])
    pieces, at = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(calls.push(list(range(at, cut))))
        at = cut
    rest, parsed = calls.finish(finish)
    return pieces, rest, parsed


@pytest.mark.parametrize("cuts", [[], list(range(1, 40)), [13, 14, 20]])
def test_a_streamed_generic_answer_sends_its_text_as_it_is_decoded_and_never_json(cuts):
    text = '{"content": "Use \\"tabs\\",\\nnot \\u00e9."}'
    pieces, rest, parsed = _stream(text, cuts)
    assert "".join(pieces) + rest == parsed.content == 'Use "tabs",\nnot é.'
    if len(cuts) > 30:  # character by character: the text comes as it is written, not at the end
        assert sum(1 for p in pieces if p) > 10
    pieces, rest, parsed = _stream('{"tool_calls": [' + PING + "]}", cuts)
    assert "".join(pieces) + rest == "" and _pairs(parsed) == [("ping", {"host": "a.b"})]


def test_a_cut_or_looping_answer_returns_its_whole_calls_once():
    looping = '{"tool_calls": [' + ", ".join([WEATHER, PING, WEATHER]) + ", "
    _, _, parsed = _stream(looping, [10], finish="stop")
    assert _pairs(parsed) == [("get_weather", {"city": "Paris", "days": 3}), ("ping", {"host": "a.b"})]
    _, _, parsed = _stream('{"tool_calls": [' + WEATHER + ', {"name": "pi', [], finish="length")
    assert _pairs(parsed) == [("get_weather", {"city": "Paris", "days": 3})]
    for cut in ('{', '{"tool_calls": [{"name": "pi'):  # no whole call: the syntax's own wrapper is no text
        pieces, rest, parsed = _stream(cut, [1], finish="length")
        assert ("".join(pieces) + rest, parsed.calls, parsed.content) == ("", (), "")
    assert first_repeat(parse_tool_calls('{"tool_calls": [' + PING + "]}", "json").calls) is None


def test_the_engine_ends_an_answer_at_the_token_that_repeats_a_call():
    text = '{"tool_calls": [' + ", ".join([WEATHER, PING, WEATHER, PING]) + "]}"
    stage = TextStage(_CharTokenizer(text), [], [], set(), 10_000, call_syntax="json")
    for i in range(len(text)):
        stage.feed([i])
        if stage.finish is not None:
            break
    assert stage.finish == "stop" and text[: len(stage.generated)].endswith(PING + ", " + WEATHER)
    again = TextStage(_CharTokenizer(text), [], [], set(), 10_000)  # not asked: it runs to the end
    for i in range(len(text)):
        again.feed([i])
    assert again.finish is None


def test_every_tool_choice_on_a_model_without_a_template_syntax_is_forced_to_the_generic_json(builtin_llm):
    for choice, parallel in (("auto", None), ("required", None), ("required", False),
                             ({"type": "function", "function": {"name": "ping"}}, None)):
        request = check_tools(TOOLS, choice, parallel, None, lambda t: None, False)
        assert request.fmt == "json" and "grammar" in request.constraint
        for seed in (1, 2):
            answer = builtin_llm.generate("x = ", max_tokens=96, temperature=1.0, seed=seed, **request.engine_options)
            parsed = parse_tool_calls(answer.text, "json")
            if answer.finish_reason == "stop" and not parsed.calls:
                assert choice == "auto" and json.loads(answer.text) == {"content": parsed.content}
            for call in parsed.calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert "content" not in tool_call_grammar([{"name": "f"}], "json", True, lambda t: None)  # required: calls only
    assert "content" in tool_call_grammar([{"name": "f"}], "json", True, lambda t: None, answer=True)


def test_a_chat_on_the_built_in_model_calls_tools_and_answers_in_plain_text(builtin_llm):
    chat = builtin_llm.chat(tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=200)
    reply = chat.send("What is the weather in Paris?")
    assert reply.tool_calls and reply.text == ""
    for call in reply.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    again = chat.send_tool_results({c.id: "sunny" for c in reply.tool_calls}, tool_choice="auto", max_tokens=120)
    assert again.tool_calls or not again.text.startswith("{")  # calls again, or the answer object's text
    talk = builtin_llm.chat(tools=TOOLS, temperature=0.0, max_tokens=40)
    chunks = list(talk.stream("What is the weather in Paris?"))  # streamed as the server streams: the text
    talk.reset()
    answer = talk.send("What is the weather in Paris?")  # auto: greedy, the built-in model answers
    assert "".join(c.text for c in chunks) == answer.text
    assert not answer.tool_calls and answer.text and not answer.text.startswith("{")  # the text, not its JSON
    assert talk.messages[-1] == {"role": "assistant", "content": answer.text}


def test_tool_choice_none_lists_the_tools_without_a_way_to_call_them():
    request = check_tools(TOOLS, "none", None, None, lambda t: None, False)
    system = prompt_parts(load_tokenizer(builtin_model(), {}, None), [], request)[0][0]["content"]
    assert "get_weather" in system and "tool_calls" not in system and "answer without calling" in system
