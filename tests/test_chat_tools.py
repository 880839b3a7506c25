"""Tool calling through the chat session (`LLM.chat(tools=...)`), on the model whose chat template
teaches Qwen 2.5's `<tool_call>` syntax (tests/tool_models.py): the same checks, grammar and parsers
as the server (`lucebox.tools`)."""

import json

import jsonschema
import pytest
from tool_models import AUTO_CALL, MALFORMED, SCHEMAS, TOOLS, qwen_tools_model

import lucebox
from lucebox.errors import InvalidArgumentError, ToolError

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return lucebox.LLM(qwen_tools_model(tmp_path_factory.mktemp("chat_tools") / "model"), draft="ngram")


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_required_and_named_calls_follow_the_schema_and_a_tool_result_goes_back_through_the_template(llm):
    chat = llm.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0)
    reply = chat.send(QUESTION)
    [call] = reply.tool_calls
    _valid(call)
    assert reply.text == "" and call.id.startswith("call_")
    assert chat.history[-1]["tool_calls"][0]["function"] == {"name": call.name,
                                                             "arguments": json.loads(call.arguments)}
    plain = llm.generate(chat.last_prompt_ids, max_tokens=64, speculate=False, **chat.tool_request.constraint)
    assert plain.token_ids == reply.token_ids  # the n-gram drafter's speculation changed nothing
    named = {"type": "function", "function": {"name": "ping"}}
    after = chat.send_tool_results({call.id: '{"temp": 21}'}, tool_choice=named, temperature=1.0, seed=2)
    [ping] = after.tool_calls
    assert ping.name == "ping"
    _valid(ping)
    prompt = llm.tokenizer.decode(chat.last_prompt_ids, skip_special_tokens=False)
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt  # the result, as the template writes it
    assert json.dumps(TOOLS[1]) in prompt and f'"name": "{call.name}"' in prompt  # the tools, the call made
    assert chat.send("thanks", tool_choice="none", max_tokens=4).tool_calls == ()


def test_auto_parses_the_model_s_calls_and_gives_a_malformed_call_back_as_text(llm):
    reply = llm.chat(tools=TOOLS, max_tokens=96, grammar=AUTO_CALL).send(QUESTION)
    assert reply.text == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("ping", {"host": "a.b"})]
    one = llm.chat(tools=TOOLS, max_tokens=96, grammar=AUTO_CALL, parallel_tool_calls=False).send(QUESTION)
    assert [c.name for c in one.tool_calls] == ["get_weather"]
    malformed = llm.chat(tools=TOOLS, max_tokens=96, grammar=MALFORMED).send(QUESTION)
    assert malformed.tool_calls == () and malformed.text.startswith("<tool_call>\n{")


def test_bad_tools_are_refused_naming_the_field_before_anything_runs(llm):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]
    cases = [({"tools": bad_schema}, "tools[0].function.parameters"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required", "json_object": True}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_parser": "xml"}, "tool_parser")]
    for options, field in cases:
        with pytest.raises(ToolError) as refused:
            llm.chat(**options)
        assert refused.value.field == field
    chat = llm.chat(tools=TOOLS, max_tokens=4)
    with pytest.raises(ToolError):
        chat.send(QUESTION, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert chat.history == []
    with pytest.raises(InvalidArgumentError, match="made none"):
        chat.send_tool_results({"call_1": "21"})


def test_a_chat_with_tools_saves_and_loads_back_mid_call(llm, tmp_path):
    """A tool chat saved while its last answer awaits results loads into a plain chat with its tools,
    renders the same prompt, and goes on with `send_tool_results`; a malformed saved call is refused."""
    chat = llm.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, tool_parser="hermes",
                    max_tokens=64, temperature=0)
    [call] = chat.send(QUESTION).tool_calls
    chat.save(tmp_path / "a.json")
    assert json.loads((tmp_path / "a.json").read_text())["tools"]["tool_parser"] == "hermes"
    other = llm.chat(max_tokens=64, temperature=0)
    other.load(tmp_path / "a.json")
    assert other.history == chat.history and other.last_tool_calls[0].id == call.id
    assert json.loads(other.last_tool_calls[0].arguments) == json.loads(call.arguments)
    assert other._render(True) == chat._render(True)  # the tools are back in the prompt
    other.save(tmp_path / "b.json")
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    reply = other.send_tool_results({call.id: '{"temp": 21}'})
    assert reply.tool_calls and other.history[-2] == {"role": "tool", "tool_call_id": call.id, "name": call.name,
                                                      "content": '{"temp": 21}'}
    record = json.loads((tmp_path / "a.json").read_text())
    for bad_call in ({**record["messages"][-1]["tool_calls"][0], "function": {"name": "f", "arguments": "{}"}},
                     "x", None):
        record["messages"][-1]["tool_calls"] = [bad_call]
        (tmp_path / "c.json").write_text(json.dumps(record))
        with pytest.raises(InvalidArgumentError, match="message 1 has \"tool_calls\""):
            other.load(tmp_path / "c.json")
    assert other.history[-1]["role"] == "assistant"  # the conversation before the refused load stays

