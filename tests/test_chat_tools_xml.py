"""Tool calls in Qwen3-Coder's and Qwen3.5's tags through a chat (`text.xml_calls`): the template is
read as teaching them; a named call is forced to its schema and goes back through the template; the
model's own calls (auto) parse with the text before them, speculation leaving them as they are."""

import json

import jsonschema
import pytest
from tool_models import SCHEMAS, TOOLS
from xml_tool_models import AUTO_XML_CALL, xml_tools_model

import lucebox

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return lucebox.LLM(xml_tools_model(tmp_path_factory.mktemp("xml_tools") / "model"), draft="ngram")


def test_a_named_call_follows_its_schema_and_goes_back_through_the_template(llm):
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = llm.chat(tools=TOOLS, tool_choice=named, max_tokens=96, temperature=0)
    assert chat.tool_request.fmt == "qwen3_coder"
    reply = chat.send(QUESTION)
    [call] = reply.tool_calls
    assert call.name == "get_weather" and reply.text == ""
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    plain = llm.generate(chat.last_prompt_ids, max_tokens=96, speculate=False, **chat.tool_request.constraint)
    assert plain.token_ids == reply.token_ids  # the n-gram drafter's speculation changed nothing
    chat.send_tool_results({call.id: '{"temp": 21}'}, tool_choice="none", max_tokens=4)
    prompt = llm.tokenizer.decode(chat.last_prompt_ids, skip_special_tokens=False)
    city = json.loads(call.arguments)["city"]
    assert "<function=get_weather>" in prompt and f"<parameter=city>\n{city}\n</parameter>" in prompt  # the call


def test_auto_parses_the_model_s_calls_with_the_text_before_them(llm):
    reply = llm.chat(tools=TOOLS, max_tokens=128, grammar=AUTO_XML_CALL).send(QUESTION)
    assert reply.text == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("ping", {"host": "a.b"})]
    one = llm.chat(tools=TOOLS, max_tokens=128, grammar=AUTO_XML_CALL, parallel_tool_calls=False).send(QUESTION)
    assert [c.name for c in one.tool_calls] == ["get_weather"]
