"""Qwen3-Coder's and Qwen3.5/3.6's tool-call syntax ("qwen3_coder", `text.xml_calls`): a template
that teaches it is told from one that teaches Hermes' JSON blocks; calls parse with typed values and
the text beside them; malformed blocks stay text; an answer cut short keeps its whole calls; and
the grammar that forces calls (`constrained.tool_grammar`) takes exactly the calls the schemas allow,
as the grammar engine checks tokens."""

import json

import pytest
import torch
from tool_models import WEATHER

from lucebox.builtin import builtin_model
from lucebox.constrained.spec import Constraint
from lucebox.constrained.state import GrammarState
from lucebox.constrained.tool_grammar import tool_call_grammar
from lucebox.text.tokenizer_files import load_tokenizer
from lucebox.text.tool_calls import complete_calls, detect_format, parse_tool_calls
from lucebox.text.xml_calls import string_parameters

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n</function>\n</tool_call>")
PING = ("<tool_call>\n<function=ping>\n<parameter=host>\na <b> c\nd\n</parameter>\n<parameter=opts>\n"
        '{"n": [1, 2]}\n</parameter>\n</function>\n</tool_call>')


def test_the_syntax_is_told_from_the_template():
    qwen35 = "{{- '<tool_call>\\n<function=' + name + '>\\n<parameter=' + key + '>\\n' }}"
    assert detect_format(qwen35) == "qwen3_coder"
    assert detect_format('<tool_call>\\n{"name": ...}</tool_call>') == "hermes"


def test_a_string_parameter_keeps_its_text_where_the_schema_says_so():
    text = CALL.replace("\n3\n", "\n7\n").replace("Paris", "true")
    assert json.loads(parse_tool_calls(text, "qwen3_coder").calls[0].arguments) == {"city": True, "days": 7}
    strings = string_parameters([{"name": "get_weather", "parameters": {"properties": {
        "city": {"type": "string"}, "days": {"enum": ["7", "1"]}}}}])
    assert json.loads(parse_tool_calls(text, "qwen3_coder", strings).calls[0].arguments) == {"city": "true",
                                                                                            "days": "7"}
    assert json.loads(complete_calls(text + "\n<tool", "qwen3_coder", strings).calls[0].arguments)["city"] == "true"


def test_calls_parse_with_typed_values_and_the_text_beside_them():
    parsed = parse_tool_calls("Let me check.\n" + CALL + "\n" + PING, "qwen3_coder")
    assert parsed.content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("ping", {"host": "a <b> c\nd", "opts": {"n": [1, 2]}})]
    assert parse_tool_calls("no calls here", "qwen3_coder").calls == ()


@pytest.mark.parametrize("text", [
    CALL.replace("<function=get_weather>", "<function=>"),  # no name
    CALL.replace("</parameter>\n<parameter=days>", "</parameter>\nstray\n<parameter=days>"),  # text between
    CALL.replace("<parameter=days>", "<parameter=city>"),  # a parameter twice
    CALL + "\n<tool_call>\n<function=x>\n",  # a block that is not a call
])
def test_a_malformed_call_leaves_the_answer_as_text(text):
    parsed = parse_tool_calls(text, "qwen3_coder")
    assert parsed.calls == () and parsed.content == text


def test_an_answer_cut_short_keeps_its_whole_calls():
    cut = complete_calls("Checking.\n" + CALL + "\n" + PING[:40], "qwen3_coder")
    assert cut.content == "Checking.\n" and [c.name for c in cut.calls] == ["get_weather"]


def _accepts(grammar: str, text: str) -> bool:
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    state = GrammarState(Constraint.lark(grammar, "tools"), tokenizer, tokenizer.vocab_size, (2,), torch.device("cpu"))
    ids = tokenizer.encode_continuation(text) + [2]
    return state.matcher.validate_tokens(ids) == len(ids)


def test_forced_calls_follow_the_schemas():
    functions = [{"name": "get_weather", "parameters": WEATHER},
                 {"name": "ping", "parameters": {"type": "object", "properties": {"host": {"type": "string"},
                                                                                 "opts": {"type": "object"}}}}]
    grammar = tool_call_grammar(functions, "qwen3_coder", True, lambda text: None)
    assert _accepts(grammar, CALL) and _accepts(grammar, CALL + "\n" + PING)
    metric = CALL.replace("</function>", "<parameter=metric>\ntrue\n</parameter>\n</function>")
    assert _accepts(grammar, metric)
    assert not _accepts(grammar, CALL.replace("Paris", "Lyon"))  # off the enum
    assert not _accepts(grammar, CALL.replace("\n3\n", "\nthree\n"))  # not an integer
    assert not _accepts(grammar, CALL.replace("<parameter=days>\n3\n</parameter>\n", ""))  # a required one missing
    assert not _accepts(grammar, CALL.replace("get_weather", "get_time"))  # no such tool
    one = tool_call_grammar(functions, "qwen3_coder", False, lambda text: None)
    assert _accepts(one, CALL) and not _accepts(one, CALL + "\n" + CALL)


def test_forced_calls_come_after_a_qwen3_5_thought():
    """Qwen3.5's generation prompt opens the thought: the calls are forced after its close only."""
    from lucebox.constrained.thought_first import answer_rule, thought_first_grammar

    calls = tool_call_grammar([{"name": "get_weather", "parameters": WEATHER}], "qwen3_coder", True, lambda text: None)
    grammar = thought_first_grammar(True, None, answer_rule(grammar=calls))
    assert _accepts(grammar, "It is about the weather.\n</think>\n\n" + CALL)
    assert not _accepts(grammar, "It is about the weather.\n</think>\n\nIt is sunny.")
