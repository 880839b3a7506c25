"""Tool calls read from each model family's own syntax (`lucebox.text.tool_calls`), malformed ones
given back as text, the syntax chosen from the chat template, and a streamed answer split into
content and calls as the whole answer is."""

import json
import shutil

import jsonschema
import pytest
from tiny_models import VOCAB
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import lucebox
from lucebox.constrained.tool_grammar import tool_call_grammar
from lucebox.text.tool_calls import detect_format, parse_tool_calls
from lucebox.tools import ToolCallStream, ToolRequest, model_tool_format

WEATHER = {"city": "Paris", "days": 3}


def _calls(text, fmt):
    parsed = parse_tool_calls(text, fmt)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("fmt, text, content", [
    # Qwen 2.5 / Hermes: a <tool_call> block per call, text before them is content
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', "Let me check."),
    # Llama 3.1+: bare JSON with "parameters", calls separated by ";", or after <|python_tag|>
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
               '{"name": "ping", "parameters": {}}', ""),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}};'
               '{"name": "ping", "parameters": {}}', ""),
    # Mistral: a JSON list after [TOOL_CALLS], or the newer name[ARGS]{...} form
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "ping", "arguments": {}}]', ""),
    ("mistral", 'ok [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]ping[ARGS]{}', "ok"),
])
def test_each_format_s_parallel_calls_are_read_with_their_arguments(fmt, text, content):
    found, calls = _calls(text, fmt)
    assert found.strip() == content
    assert calls == [("get_weather", WEATHER), ("ping", {})]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),  # cut by max_tokens
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some'),
    ("llama3", "{not json at all}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS]get_weather{}"),  # no [ARGS]
    ("hermes", "<tool_call>" + "[" * 100000 + "</tool_call>"),  # deeper than json can read
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {"host": "\\ud800"}}\n</tool_call>'),  # a lone surrogate
    # what no reader of the answer takes back (the server's, a saved chat's): the call would not round-trip
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1e999}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1' + "0" * 150 + '}}\n</tool_call>'),
])
def test_a_malformed_call_comes_back_whole_as_text(fmt, text):
    assert _calls(text, fmt) == (text, [])


def test_plain_answers_have_no_calls_and_arguments_given_as_json_text_are_read():
    assert _calls("The weather is fine.", "hermes") == ("The weather is fine.", [])
    assert _calls("I'd say {maybe}", "llama3") == ("I'd say {maybe}", [])  # JSON only counts as the whole answer
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 3}"}\n</tool_call>'
    assert _calls(text, "hermes")[1] == [("get_weather", WEATHER)]
    assert len(parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}]', "mistral").calls[0].id) == 9


def test_the_format_is_chosen_from_what_the_template_writes():
    assert detect_format("{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert detect_format("{{- '[TOOL_CALLS][' }}") == "mistral"
    assert detect_format("{{- '<|python_tag|>' + tool_call.name }}") == "llama3"  # Llama 3.1
    assert detect_format("{%- if message.role == 'ipython' or message.role == 'tool' %}") == "llama3"  # 3.2
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_format(None) is None


class _CharTokenizer:
    """Token i is character i of TEXT: a tokenizer for splitting answers anywhere."""

    def __init__(self, text):
        self.text = text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.text[i] for i in ids if i >= 0)


def _stream(text, fmt, cuts, stops=(), names=("get_weather", "ping"), parallel=True):
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    calls = ToolCallStream(_CharTokenizer(text), ToolRequest(tools, "auto", parallel, fmt, {}), [-1], list(stops))
    pieces, at = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(calls.push(list(range(at, cut))))
        at = cut
    rest, parsed = calls.finish()
    return pieces, rest, parsed


@pytest.mark.parametrize("cuts", [[], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [9, 10, 30]])
def test_a_streamed_answer_sends_the_text_before_a_call_and_never_a_piece_of_its_marker(cuts):
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    pieces, rest, parsed = _stream(text, "hermes", cuts)
    assert all("<" not in p for p in pieces)
    assert "".join(pieces) + rest == parsed.content == "Checking.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", WEATHER)]


def test_a_streamed_malformed_call_a_call_to_an_unknown_tool_and_a_stop_string_end_as_text():
    broken = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }</tool_call>'
    pieces, rest, parsed = _stream(broken, "hermes", [2, 5, 9])
    assert "".join(pieces) + rest == broken and parsed.calls == ()
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert _stream(unknown, "hermes", [4])[2].calls == ()
    pieces, rest, parsed = _stream("one two END three", "hermes", [5, 9, 10, 13], stops=["END"])
    assert "".join(pieces) + rest == "one two " and parsed.content == "one two "
    _, _, parsed = _stream('{"name": "ping", "parameters": {}}; {"name": "ping", "parameters": {}}', "llama3", [3],
                           parallel=False)
    assert len(parsed.calls) == 1  # parallel_tool_calls=false: the first call


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
          "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("fmt, mistral_args", [("hermes", False), ("llama3", False), ("mistral", False),
                                               ("mistral", True)])
def test_a_forced_call_in_each_syntax_follows_its_schema_and_parses_back(builtin_llm, fmt, mistral_args):
    functions = [{"name": "get_weather", "parameters": SCHEMA},
                 {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]
    grammar = tool_call_grammar(functions, fmt, False, lambda text: None, mistral_args)
    answer = builtin_llm.generate("x = ", max_tokens=64, temperature=1.0, seed=4, grammar=grammar)
    [call] = parse_tool_calls(answer.text, fmt).calls
    arguments = json.loads(call.arguments)
    assert answer.finish_reason == "stop" and call.name in ("get_weather", "ping")
    if call.name == "get_weather":
        jsonschema.validate(arguments, SCHEMA)
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(fmt)
    if marker:  # a marker the vocabulary holds as one token is written as that token
        assert "<[7]>" in tool_call_grammar(functions, fmt, False, {marker: 7}.get, mistral_args)


MISTRAL_TEMPLATE = ("{% for m in messages %}[INST]{{ m['content'] }}[/INST]{% endfor %}"
                    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{# calls are written [TOOL_CALLS]name[ARGS]{...} #}")


def test_a_special_token_marker_is_forced_as_its_token_and_read_back_from_it(reference_models, tmp_path):
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens: the grammar writes them as tokens, plain
    decoding drops them, and the calls are read from the text with them kept."""
    folder, _ = reference_models("mistral")
    dest = shutil.copytree(folder, tmp_path / "model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(['{"host": "abc", "port": 12} ping [] 0123456789'] * 5, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["</s>", "[TOOL_CALLS]", "[ARGS]"]))
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": MISTRAL_TEMPLATE}))
    llm = lucebox.LLM(dest, device="cpu", dtype="float32")
    assert model_tool_format(llm, None) == ("mistral", True)
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {"port": {"type": "integer", "minimum": 1,
            "maximum": 99}}, "required": ["port"], "additionalProperties": False}}
    grammar = tool_call_grammar([ping], "mistral", False, llm.tokenizer.token_to_id, True)
    answer = llm.generate(llm.tokenizer.encode("ping"), max_tokens=24, temperature=1.0, seed=0, grammar=grammar)
    assert answer.token_ids[0] == llm.tokenizer.token_to_id("[TOOL_CALLS]") and "[TOOL_CALLS]" not in answer.text
    request = ToolRequest([{"type": "function", "function": ping}], "required", False, "mistral", {})
    calls = ToolCallStream(llm.tokenizer, request, llm.eos_token_ids, [])
    assert calls.push(answer.token_ids) == ""
    _, parsed = calls.finish()
    [call] = parsed.calls
    assert call.name == "ping" and 1 <= json.loads(call.arguments)["port"] <= 99
