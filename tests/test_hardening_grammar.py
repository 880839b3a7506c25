"""Grammars, JSON Schemas and tool requests a client can send to crash or mislead the engine
(issue 39, classes 1 and 5, and the grammar parts of 3 and 4): each is a typed error naming the
field (a 400/422 on the server, which keeps serving), found before llguidance's native code sees
it; the largest a bound lets through compiles (checked in a subprocess, where a crash is an exit
status, not the end of pytest)."""

import json
import subprocess
import sys

import pytest
from tool_models import TOOLS

import lucebox
import lucebox.constrained.schema_check as schema_check
import lucebox.constrained.spec as spec
from lucebox.chat.saved_chat import chat_record
from lucebox.constrained import Constraint
from lucebox.constrained.bounds import MAX_WEIGHT, check_grammar, check_schema
from lucebox.constrained.schema_check import follows_schema
from lucebox.constrained.spec import refuse_stops
from lucebox.errors import GrammarError, ToolError
from lucebox.text.tool_calls import parse_tool_calls
from lucebox.tools import check_tools

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the shapes that crashed llguidance 1.9.1 (tens of KB each) -------------------------------------


def ref_chain(n: int) -> dict:
    """{"$ref": d0}, d0 -> d1 -> ... -> dn, a string: ~2,600 of them segfaulted the compile."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def map_chain(n: int) -> dict:
    """References each through two levels of additionalProperties: the costliest per hop measured (~700)."""
    def hop(i):
        return {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": {
            "$ref": f"#/$defs/d{i + 1}"}}}
    return {"$ref": "#/$defs/d0", "$defs": {**{f"d{i}": hop(i) for i in range(n)}, f"d{n}": {"type": "integer"}}}


def lark_chain(n: int) -> str:
    """start: r0, r0: r1, ...: ~2,800 rules segfaulted."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "x"'])


def gbnf_chain(n: int) -> str:
    return "\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(n)), f'r{n} ::= "x"'])


def nested(n: int, key: str) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema} if key == "items" else {"anyOf": [schema, {"type": "null"}]}
    return schema


def largest(make, check) -> object:
    """The largest make(n) that `check` lets through (found by bisection: make(1) passes, make(4096) not)."""
    def passes(n: int) -> bool:
        try:
            check(make(n))
        except GrammarError:
            return False
        return True

    low, high = 1, 4096
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if passes(middle) else (low, middle)
    return make(low)


class _NoEngine:
    def __getattr__(self, name):
        raise AssertionError(f"llguidance.{name} was reached: the bound did not hold")


@pytest.fixture
def no_engine(monkeypatch):
    """llguidance unreachable: a shape the bounds miss fails the test instead of ending pytest."""
    monkeypatch.setattr(spec, "llguidance", lambda: _NoEngine())
    monkeypatch.setattr(schema_check, "llguidance", lambda: _NoEngine())


@pytest.mark.parametrize("make, field", [
    (lambda: Constraint.json_schema(ref_chain(2800)), "json_schema"),
    (lambda: Constraint.json_schema(json.dumps(ref_chain(2800))), "json_schema"),  # ~106 KB of JSON text
    (lambda: Constraint.json_schema(map_chain(700)), "json_schema"),
    (lambda: Constraint.json_schema(nested(5000, "items")), "json_schema"),
    (lambda: Constraint.json_schema(nested(5000, "anyOf")), "json_schema"),
    (lambda: Constraint.lark(lark_chain(5000)), "grammar"),  # ~68 KB
    (lambda: Constraint.lark(gbnf_chain(5000)), "grammar"),
    (lambda: Constraint.lark("start: %json " + json.dumps(ref_chain(2800))), "grammar"),
    (lambda: Constraint.lark("start: %json " + '{"items": ' * 100000), "grammar"),
    (lambda: follows_schema("{}", ref_chain(2800)), "parameters"),
])
def test_schemas_and_grammars_past_the_bounds_are_refused_before_llguidance_sees_them(no_engine, make, field):
    with pytest.raises(GrammarError) as refused:
        make()
    assert refused.value.field == field and "\n" not in str(refused.value)


def test_tool_parameters_past_the_bounds_are_refused_under_every_tool_choice(no_engine):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", **ref_chain(2800)}}}]
    for choice in ("auto", "none", "required"):
        with pytest.raises(ToolError) as refused:
            check_tools(tools, choice, None, "hermes", lambda text: None, False)
        assert (refused.value.field, refused.value.status) == ("tools[0].function.parameters", 400)


LARGEST_COMPILE = """
import json, sys, threading
from lucebox.constrained import Constraint
from lucebox.constrained.schema_check import follows_schema
from lucebox.constrained.spec import refuse_stops
shapes = json.loads(sys.stdin.read())

def compile_all():
    for schema in shapes["schemas"]:
        Constraint.json_schema(schema)
        follows_schema("1", schema)
    Constraint.lark(shapes["lark"])
    Constraint.lark(shapes["gbnf"])
    print("compiled")

threading.stack_size(1 << 20)  # a caller with a small stack (musl's threads have 128 KiB)
caller = threading.Thread(target=compile_all)
caller.start()
caller.join()
"""


def test_the_largest_schemas_and_grammars_the_bounds_let_through_compile(tmp_path):
    """At the bound, each crashing shape compiles, called from a thread with a 1 MiB stack (the compile
    runs on a 64 MiB one of its own: `constrained.native`); in a subprocess, where a bound too loose
    is a segfault that fails this test. The crashes measured sit over 3x above (`constrained.bounds`)."""
    schemas = [largest(ref_chain, lambda s: check_schema(s, "s")), largest(map_chain, lambda s: check_schema(s, "s"))]
    lark, gbnf = (largest(make, lambda g: check_grammar(g, "g")) for make in (lark_chain, gbnf_chain))
    assert len(schemas[0]["$defs"]) > 300 and lark.count("\n") > MAX_WEIGHT - 20
    shapes = json.dumps({"schemas": schemas, "lark": lark, "gbnf": gbnf})
    done = subprocess.run([sys.executable, "-c", LARGEST_COMPILE], input=shapes, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "compiled"), done.stderr[-2000:]


@pytest.mark.parametrize("schema, loop", [
    ({"$ref": "#"}, "# -> #"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
     "#/$defs/a -> #/$defs/b -> #/$defs/a"),
    ({"allOf": [{"$ref": "#"}]}, "# -> #/allOf/0 -> #"),
    # every branch of an anyOf / oneOf comes back (the re-audit: named "vocabulary cannot write" before)
    ({"oneOf": [{"$ref": "#"}]}, "#, #/oneOf/0"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}}, "#, #/$defs/a, #/$defs/a/anyOf/0"),
    ({"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]}, "#, #/anyOf/1, #/anyOf/1/allOf/0"),
])
def test_a_ref_loop_that_writes_nothing_is_named_as_such(schema, loop):
    with pytest.raises(GrammarError) as refused:
        Constraint.json_schema(schema, "response_format.json_schema.schema")
    assert refused.value.field == "response_format.json_schema.schema"
    assert f"$ref loop that writes nothing ({loop})" in str(refused.value)


def test_recursion_that_writes_between_its_steps_is_a_schema_like_any_other():
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {
        "$ref": "#"}}}}
    assert follows_schema('{"name": "a", "children": [{"name": "b", "children": []}]}', tree)
    Constraint.json_schema({"anyOf": [{"$ref": "#"}, {"type": "string"}]})  # the string branch writes
    Constraint.json_schema({"anyOf": [{"$ref": "#"}, True]})  # so does `true` (any value)


def test_schema_text_and_call_arguments_past_the_json_bounds_are_errors_naming_the_field():
    for text, bound in (('{"maximum": ' + "9" * 5000 + "}", "numbers are at most"),
                        ("[" * 100000 + "]" * 100000, "more than 100 deep")):
        with pytest.raises(GrammarError) as refused:
            Constraint.json_schema(text, "response_format.json_schema.schema")
        assert refused.value.field == "response_format.json_schema.schema" and bound in str(refused.value)
        # a model that writes such arguments wrote text, not a call
        written = '<tool_call>\n{"name": "f", "arguments": ' + json.dumps(text) + "}\n</tool_call>"
        assert parse_tool_calls(written, "hermes").calls == ()
    deep = '<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * 150 + "]" * 150 + "}}\n</tool_call>"
    assert parse_tool_calls(deep, "hermes").calls == ()


def test_only_stop_strings_that_could_cut_the_json_are_refused():
    compact, flexible = {"type": "object"}, {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    refuse_stops(["\n\n"], "json_schema", compact)  # compact JSON never writes a newline: it cannot cut it
    refuse_stops(None, "tool calls")
    for stop, schema in (([":"], compact), (["\n"], flexible), (["}"], json.dumps(compact)), (["\n"], None)):
        with pytest.raises(GrammarError) as refused:
            refuse_stops(stop, "json_schema", schema)
        assert refused.value.field == "stop" and repr(stop[0]) in str(refused.value)


def test_llm_generate_refuses_a_stop_string_that_could_cut_its_json(builtin_llm):
    for options in ({"json_schema": {"type": "object"}}, {"json_object": True}):
        with pytest.raises(GrammarError) as refused:
            builtin_llm.generate("x", max_tokens=4, stop=[":"], **options)
        assert refused.value.field == "stop"
    assert builtin_llm.generate("x", max_tokens=4, stop=["\n\n"], json_object=True).token_ids  # cannot cut compact JSON


WIDE_RULE = 'start: w "=" x\nw: /[a-z]{1,3}/\nx: ' + " | ".join(f'"v{i}"' for i in range(2500)) + "\n"
WIDE_ANY_OF = {"type": "object", "required": ["k", "a"], "properties": {
    "k": {"type": "string", "maxLength": 3},
    "a": {"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "integer"}}, "required": [f"p{i}"]}
                    for i in range(2100)]}}}
NO_FINITE_VALUE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize("options", [{"grammar": WIDE_RULE}, {"json_schema": WIDE_ANY_OF},
                                     {"json_schema": NO_FINITE_VALUE}], ids=["rule", "any-of", "no-finite-value"])
def test_a_grammar_past_the_engine_s_parser_limits_is_an_error_naming_it_with_speculation_or_without(options):
    """llguidance gives up mid-output on a row of over 2,000 parse items or 50,000 forced ones: the same
    GrammarError naming the argument, whether a draft walked there first (the walk's rows stay empty and
    its matcher is rebuilt: only committing that draft meets the error, as plain decoding does) or not.
    Was: "this is a bug in lucebox", and a 500 from the server."""
    llm = lucebox.LLM(adaptive=False)  # the drafter drafts every round
    (field,) = options
    for speculate in (True, False):
        with pytest.raises(GrammarError, match="more than the grammar engine can follow") as refused:
            llm.generate("# data\nx = 1\n", max_tokens=30, temperature=0.0, speculate=speculate, **options)
        assert refused.value.field == field
    assert llm.generate("# data\nx = 1\n", max_tokens=8, grammar='start: "x = " /[0-9]+/').text.startswith("x = ")


def test_a_draft_into_a_branch_past_the_limits_leaves_the_request_as_plain_decoding_would(builtin_llm):
    """Only committing the draft that leads past the limit meets the error: a draft walked into the
    2,500-alternative branch leaves its row empty (it was an error before), and a round that commits
    the other branch goes on; one that commits the draft, or a token chosen from the empty row, is the
    GrammarError plain decoding meets there."""
    import torch

    from lucebox.constrained import GrammarState

    tokenizer = builtin_llm.tokenizer
    (a,), (b,) = (tokenizer.encode(text, add_special_tokens=False) for text in ("a", "bc"))
    grammar = 'start: "a" x | "b" "c"\nx: ' + " | ".join(f'"v{i}"' for i in range(2500)) + "\n"

    def state():
        return GrammarState(Constraint.lark(grammar), tokenizer, builtin_llm.config.vocab_size,
                            tuple(builtin_llm.eos_token_ids), torch.device("cpu"))

    kept = state()
    rows = kept.allowed([a])
    assert rows[0, a] and rows[0, b] and not rows[1].any()  # the walk past "a" followed nothing
    kept.commit([b])  # the target wrote "bc": the request goes on, its matcher whole
    assert kept.matcher.is_accepting() and kept.allowed([]).any()
    for committed in ([a, 0], [a]):
        cut = state()
        cut.allowed([a])
        with pytest.raises(GrammarError, match="more than the grammar engine can follow") as refused:
            cut.commit(committed)
        assert refused.value.field == "grammar"


def test_engine_messages_are_one_line():
    for grammar in ("start: " + "(" * 60 + '"x"' + ")" * 60, "start: /" + "(" * 1000 + "a" + ")" * 1000 + "/"):
        with pytest.raises(GrammarError) as refused:
            Constraint.lark(grammar)
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 500


def test_a_stop_lexeme_grammar_speculates_and_gives_the_plain_tokens():
    """`name[stop=...]` lexemes cannot be rolled back in llguidance: the drafts' masks are then
    computed on a copy of the matcher (was: 'rollback not supported', an error mid-output)."""
    llm = lucebox.LLM(adaptive=False)  # the drafter drafts every round
    grammar = 'start: "x = " val "\\n" "y"\nval[stop="\\n"]: /[a-z0-9_ =(),.]+/'
    drafted = 0
    for prompt in ("# data\nx = 1\n", "def f(x):\n    return x + 1\n\nx = "):
        spec_ = llm.generate(prompt, max_tokens=40, grammar=grammar)
        plain = llm.generate(prompt, max_tokens=40, grammar=grammar, speculate=False)
        assert spec_.token_ids == plain.token_ids and spec_.finish_reason == "stop"
        drafted += sum(k * n for k, n in spec_.stats["width_histogram"].items())
    assert drafted > 0


# -- through the server --------------------------------------------------------------------------------


def _answer(tools_server, body: dict):
    code, reply, _ = tools_server.post("/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 4,
                                                                     **body}).encode())
    return code, reply


def _schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _call(arguments: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


SCHEMA_FIELD = "response_format.json_schema.schema"
REFUSED = [  # (body, status, param, words of the message)
    # class 1: crafted sizes that segfaulted the server
    (_schema_format(ref_chain(2800)), 400, SCHEMA_FIELD, "too large"),
    ({"grammar": lark_chain(5000)}, 400, "grammar", "rules"),
    ({"tools": _tool({"type": "object", **ref_chain(2800)}), "tool_choice": "auto"}, 400,
     "tools[0].function.parameters", "too large"),
    # class 3: JSON text past the bounds
    (_schema_format('{"maximum": ' + "9" * 5000 + "}"), 400, SCHEMA_FIELD, "numbers are at most"),
    (_schema_format("[" * 100000 + "]" * 100000), 400, SCHEMA_FIELD, "more than 100 deep"),
    ({"messages": [*MESSAGES, _call("[" * 100000 + "]" * 100000)]}, 422,
     "messages[1].tool_calls[0].function.arguments", "more than 100 deep"),
    ({"messages": [*MESSAGES, _call('{"n": ' + "9" * 5000 + "}")]}, 422,
     "messages[1].tool_calls[0].function.arguments", "numbers are at most"),
    # class 5: what the engine cannot honour
    (_schema_format({"type": "object", "x-guidance": "s"}), 400, SCHEMA_FIELD + ".x-guidance", "must be an object"),
    ({"tools": _tool({"type": "object", "x-guidance": "s"}), "tool_choice": "required"}, 400,
     "tools[0].function.parameters.x-guidance", "must be an object"),
    ({"tools": _tool({"type": "string"}), "tool_choice": "required"}, 400, "tools[0].function.parameters",
     "arguments are a JSON object"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": ['"']}, 400, "stop", "inside the JSON"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}}, "stop": "}"}, 400, "stop",
     "inside the JSON"),
    ({**_schema_format({"type": "object"}), "stop": [":"]}, 400, "stop", "inside the JSON"),
    ({"response_format": {"type": "json_object"}, "stop": [":"]}, 400, "stop", "inside the JSON"),
    ({"messages": [*MESSAGES, _call("{}"), {"role": "tool", "tool_call_id": "c2", "content": "1"}]}, 400,
     "messages[2].tool_call_id", "not the id of a call"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, 400, "messages[1]",
     "must follow an assistant message with tool_calls"),
    (_schema_format({"$ref": "#"}), 400, SCHEMA_FIELD, "$ref loop"),
    (_schema_format({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}), 400,
     SCHEMA_FIELD, "$ref loop"),
    ({"grammar": "start: " + "(" * 60 + '"x"' + ")" * 60}, 400, "grammar", "too deeply nested"),
]


def test_crafted_and_unservable_requests_get_an_error_naming_the_field_and_the_server_keeps_serving(tools_server):
    before = tools_server.metric("requests_total")
    for body, status, param, words in REFUSED:
        code, reply = _answer(tools_server, body)
        error = reply["error"]
        assert (code, error["param"]) == (status, param), (str(body)[:200], error)
        assert words in error["message"] and "\n" not in error["message"], error["message"]
    assert tools_server.metric("requests_total") == before  # nothing reached the engine
    assert tools_server.proc.poll() is None
    answered = [*MESSAGES, _call('{"city": "Paris"}'), {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    code, reply = _answer(tools_server, {"messages": answered, "tools": TOOLS})
    assert code == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


# -- the chat session --------------------------------------------------------------------------------


def test_a_saved_chat_with_unusable_tools_or_grammar_is_one_typed_line_and_the_chat_is_kept(tools_model, tmp_path):
    llm = lucebox.LLM(str(tools_model))
    chat = llm.chat(max_tokens=4)
    chat.send("hello")
    kept = chat.history
    bad_tools = {"tools": _tool({"type": "object", "x-guidance": "s"}), "tool_choice": "required"}
    deep = "start: " + "(" * 60 + '"x"' + ")" * 60
    for settings, tools, field in (({}, bad_tools, "tools[0].function.parameters.x-guidance"),
                                   ({"grammar": deep}, None, "grammar"),
                                   ({"json_object": True, "stop": [":"]}, None, "stop")):
        path = tmp_path / f"{field}.json"
        path.write_text(chat_record(str(tools_model), None, {**chat.settings, **settings}, kept[:1], tools))
        with pytest.raises((ToolError, GrammarError)) as refused:
            chat.load(path)
        assert refused.value.field == field and "\n" not in str(refused.value)
        assert chat.history == kept
    with pytest.raises(GrammarError) as refused:
        llm.chat(json_schema={"type": "object"}, stop=[":"])
    assert refused.value.field == "stop"
