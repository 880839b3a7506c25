"""A server that strangers can reach: hostile requests from every class the audit of issue 39 found
(grammars and schemas built to overflow the grammar engine's native stack, JSON past every bound,
tool requests the engine cannot honour, an oversized header) each get a 4xx naming the field, one
after another on one server, which then answers a normal request with the tokens a fresh engine
gives; and random hostile JSON spliced into valid requests never gets a 5xx (nor a dead server)."""

import json
import random
import socket
import time

import pytest
from fuzzing import hostile_json, splice_hostile

import lucebox
from lucebox.chat.settings import model_defaults
from lucebox.server.process import ServerProcess

KEY = "sk-hostile"
SEED, FUZZ_CASES, FUZZ_SECONDS = 31, 60, 20.0


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--tool-parser", "hermes", "--read-timeout", "2", api_key=KEY)  # the default drafter: on
    yield s
    assert s.stop() == 0


def ref_chain(n: int) -> dict:
    """A schema whose `$ref`s follow each other n deep: one flat object, nested only by reference."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def nested_properties(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def tool(parameters, name="lookup") -> list[dict]:
    return [{"type": "function", "function": {"name": name, "parameters": parameters}}]


WORD = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
USER = [{"role": "user", "content": "def f(x):"}]


def call_message(arguments: str) -> list[dict]:
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# (endpoint, body (dict, or raw bytes), the field the 4xx must name: None for a body-wide error)
HOSTILE = {
    "a $ref chain 3,000 long (segfaulted the grammar engine)":
        ("chat", {"messages": USER, "response_format": schema_format(ref_chain(3_000))},
         "response_format.json_schema.schema"),
    "a Lark chain of 5,000 rules": ("completion", {"prompt": "x", "grammar": lark_chain(5_000)}, "grammar"),
    "a GBNF chain of 5,000 rules": ("completion", {"prompt": "x", "grammar": "root ::= r0\n" + "".join(
        f"r{i} ::= r{i + 1}\n" for i in range(5_000)) + 'r5000 ::= "x"\n'}, "grammar"),
    "a $ref chain in a tool, tool_choice auto":
        ("chat", {"messages": USER, "tools": tool(ref_chain(3_000)), "tool_choice": "auto"},
         "tools[0].function.parameters"),
    "properties nested 120 deep": ("chat", {"messages": USER, "response_format": schema_format(nested_properties(60))},
                                   None),
    "a schema as JSON text with a 5,000-digit number":
        ("chat", {"messages": USER, "response_format": schema_format('{"type": "integer", "maximum": 1'
                                                                      + "0" * 4999 + "}")},
         "response_format.json_schema.schema"),
    "a schema as JSON text nested 100,000 deep":
        ("chat", {"messages": USER, "response_format": schema_format("[" * 100_000 + "]" * 100_000)},
         "response_format.json_schema.schema"),
    "a body nested 100,000 deep": ("chat", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    "a body with a 5,000-digit number": ("completion", b'{"prompt": "x", "max_tokens": 1' + b"0" * 4999 + b"}", None),
    "tool-call arguments nested 100,000 deep":
        ("chat", {"messages": call_message("[" * 100_000 + "]" * 100_000), "tools": tool(WORD)}, "messages[1]"),
    "tool-call arguments with a 5,000-digit number":
        ("chat", {"messages": call_message('{"word": 1' + "0" * 4999 + "}"), "tools": tool(WORD)}, "messages[1]"),
    "x-guidance that is not an object":
        ("chat", {"messages": USER, "tools": tool({**WORD, "x-guidance": "s"}), "tool_choice": "required"},
         "tools[0].function.parameters"),
    "a string-typed tool under required":
        ("chat", {"messages": USER, "tools": tool({"type": "string"}), "tool_choice": "required"},
         "tools[0].function.parameters"),
    "a schema that refers to itself": ("chat", {"messages": USER, "response_format": schema_format({"$ref": "#"})},
                                       "response_format.json_schema.schema"),
    "a $ref loop": ("chat", {"messages": USER, "response_format": schema_format(
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})},
                   "response_format.json_schema.schema"),
    "a tool result answering no call":
        ("chat", {"messages": [*USER, {"role": "assistant", "content": "hi"},
                               {"role": "tool", "tool_call_id": "nowhere", "content": "ok"}], "tools": tool(WORD)},
         "messages[2]"),
    "a tool result whose id matches no call":
        ("chat", {"messages": [*call_message("{}")[:2], {"role": "tool", "tool_call_id": "c2", "content": "ok"}],
                  "tools": tool(WORD)}, "messages[2]"),
    "reasoning asked of a model that does not reason": ("chat", {"messages": USER, "reasoning_effort": "high"},
                                                         "reasoning_effort"),
    "a rule of 2,500 alternatives met mid-output (was a 500)":
        ("chat", {"messages": USER, "max_tokens": 30, "temperature": 0,
                  "grammar": 'start: w "=" x\nw: /[a-z]{1,3}/\nx: ' + " | ".join(f'"v{i}"' for i in range(2500))},
         "grammar"),
    "a schema no finite value follows": ("chat", {"messages": USER, "response_format": schema_format(
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})},
                                         "response_format.json_schema.schema"),
    "a schema and a stop string that cuts its JSON":
        ("chat", {"messages": USER, "response_format": schema_format(WORD), "stop": [":"]}, "stop"),
    "a tool pattern the lexer cannot expand, met mid-output (was a 400 calling itself a bug)":
        ("chat", {"messages": USER, "max_tokens": 10, "temperature": 0, "tool_choice": "required", "tools": tool(
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
             "required": ["a"]})}, "tools"),
    "an earlier call's arguments holding a lone surrogate escape":
        ("chat", {"messages": call_message('{"word": "\\ud800"}'), "tools": tool(WORD)},
         "messages[1].tool_calls[0].function.arguments"),
    "required tools and a stop string inside the call":
        ("chat", {"messages": USER, "tools": tool(WORD), "tool_choice": "required", "stop": ["word"]}, "stop"),
}


def _post(server, endpoint: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps({"max_tokens": 4, **body}).encode()
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    code, reply, _ = server.post(path, data)
    return code, reply


def _big_header(server) -> bytes:
    request = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(request)
        answer = b""
        while part := conn.recv(65536):
            answer += part
    return answer.split(b"\r\n")[0]


def _greedy(server, prompt: str) -> tuple[int, str]:
    code, reply = _post(server, "completion", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
    return code, reply["choices"][0]["text"] if code == 200 else reply


def test_twenty_hostile_requests_in_a_row_get_4xx_naming_the_field_and_the_server_answers_as_a_fresh_one(server):
    assert len(HOSTILE) >= 20
    wrong = []
    for name, (endpoint, body, field) in HOSTILE.items():
        code, reply = _post(server, endpoint, body)
        param = reply.get("error", {}).get("param") or ""
        if not (400 <= code < 500 and (field is None or param.startswith(field))):
            wrong.append(f"{name}: {code} {param!r} {str(reply)[:300]}")
        assert server.proc.poll() is None, f"the server died on: {name}\n{server.output()[-3000:]}"
    status = _big_header(server)
    assert status.startswith(b"HTTP/1.1 4"), status  # headers past 16 KiB are refused
    assert not wrong, "\n".join(wrong)
    llm = lucebox.LLM()
    prompt = "import sys\n\n\ndef main(argv):\n"
    expected = llm.generate(prompt, **{**model_defaults(llm.description.generation_config), "max_tokens": 16,
                                       "temperature": 0.0})
    assert _greedy(server, prompt) == (200, expected.text)
    assert "Traceback" not in server.output()


def near_the_bounds(rng) -> str:
    """JSON the body reader takes, hostile to what reads the value next: nesting and numbers just
    inside the bounds, or hostile JSON as a string (a schema or tool-call arguments given as text)."""
    depth = rng.choice([40, 90, 99])
    return rng.choice([
        "[" * depth + "]" * depth, '{"type": ' * depth + "1" + "}" * depth,
        "9" * 99, "-" + "9" * 99, "1e308", "-0." + "0" * 95 + "1",
        json.dumps(hostile_json(rng)), json.dumps(json.dumps(ref_chain(3_000))), json.dumps(lark_chain(3_000)),
    ])


def test_random_hostile_json_in_valid_requests_never_gets_a_5xx(server):
    rng = random.Random(SEED)
    bodies = [{"messages": USER, "max_tokens": 2, "response_format": schema_format(WORD)},
              {"messages": call_message('{"word": "x"}'), "tools": tool(WORD), "tool_choice": "auto", "max_tokens": 2},
              {"prompt": "x", "max_tokens": 2, "logprobs": 2, "stop": ["\n"], "seed": 3}]
    start, tried, wrong, codes = time.perf_counter(), 0, [], {}
    while tried < FUZZ_CASES and time.perf_counter() - start < FUZZ_SECONDS:
        body = rng.choice(bodies)
        data = splice_hostile(rng, body, rng.choice([hostile_json, near_the_bounds])(rng)).encode()
        code, reply = _post(server, "chat" if "messages" in body else "completion", data)
        tried += 1
        codes[code] = codes.get(code, 0) + 1
        if not (400 <= code < 500 or code == 200):
            wrong.append(f"{code} {str(reply)[:200]} <- {data[:200]!r}")
        assert server.proc.poll() is None, f"the server died on {data[:300]!r}"
    print(f"fuzz: {tried} hostile requests in {time.perf_counter() - start:.1f} s (seed {SEED}); answers {codes}")
    assert tried >= 20 and not wrong, "\n".join(wrong[:10])
    assert "Traceback" not in server.output()
