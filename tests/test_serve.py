"""`lucebox serve` as its users meet it: a server in a subprocess on a free localhost port, spoken to
with the official `openai` client (and raw HTTP for the faults a client library would not send)."""

import http.client
import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
import warnings

import jsonschema
import pytest
from structured_schemas import SCHEMAS

import lucebox
import lucebox.cli
from lucebox.chat.conversation import encode_all, render
from lucebox.chat.settings import model_defaults
from lucebox.cli import build_parser
from lucebox.errors import LuceboxWarning
from lucebox.server.command import settings_from
from lucebox.server.connections import KEEP_ALIVE_SECONDS, HeaderDeadlineProtocol, uvicorn_config
from lucebox.server.guard import HostGuard
from lucebox.server.process import ServerProcess

openai = pytest.importorskip("openai")
KEY = "sk-lucebox-test"


class Server(ServerProcess):
    def __init__(self, *flags):
        super().__init__(*flags, api_key=KEY)

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-body-bytes", "65536", "--read-timeout", "1")  # slow clients are cut off quickly
    yield s
    assert s.stop() == 0  # Ctrl-C ends it cleanly


@pytest.fixture(scope="module")
def llm():
    return lucebox.LLM()


def _generate(llm, prompt, **options):
    """What LLM.generate gives with the sampling defaults the server applies (the model's
    generation_config.json, under what the request sets)."""
    return llm.generate(prompt, **{**model_defaults(llm.description.generation_config), **options})


def _chat_ids(llm, messages):
    return encode_all(llm.tokenizer, render(llm.tokenizer, messages, add_generation_prompt=True))


MESSAGES = [{"role": "system", "content": "# string helpers"}, {"role": "user", "content": "def reverse(s):"}]


def test_chat_and_completions_streamed_or_not_are_llm_generate(server, llm):
    client = server.client()
    ids = _chat_ids(llm, MESSAGES)
    expected = _generate(llm, ids, max_tokens=24, temperature=0.0, stop=["\n\n\n"])
    reply = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    assert reply.usage.total_tokens == len(ids) + len(expected.token_ids)
    events = list(client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected.text
    assert events[-1].usage.completion_tokens == len(expected.token_ids)
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == expected.finish_reason

    prompt = "import os\n\n\ndef walk(top):\n"
    expected = _generate(llm, prompt, max_tokens=20, temperature=0.0)
    text = client.completions.create(model="laguna-code-6m", prompt=prompt, max_tokens=20, temperature=0)
    assert text.choices[0].text == expected.text and text.usage.completion_tokens == 20
    streamed = client.completions.create(model="laguna-code-6m", prompt=prompt, max_tokens=20, temperature=0,
                                         stream=True)
    assert "".join(e.choices[0].text for e in streamed) == expected.text
    assert [m.id for m in client.models.list()] == ["laguna-code-6m"]


def test_stop_strings_and_seeds(server, llm):
    client = server.client()
    free = client.completions.create(model="laguna-code-6m", prompt="class Node:\n", max_tokens=30,
                                     temperature=0).choices[0].text
    stop = free[10:13]
    cut = client.completions.create(model="laguna-code-6m", prompt="class Node:\n", max_tokens=30, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.text == free[: free.index(stop)] and cut.finish_reason == "stop"

    def sampled(seed):
        return client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=24,
                                              temperature=0.9, seed=seed).choices[0].message.content

    assert sampled(7) == sampled(7)
    assert len({sampled(7), sampled(8), sampled(9)}) > 1


def test_structured_output_through_the_official_client_validates_and_bad_constraints_get_400s(server, llm):
    client = server.client()
    for i, schema in enumerate(SCHEMAS):  # all 22, each greedy (chat) and sampled (completions)
        fmt = {"type": "json_schema", "json_schema": {"name": f"schema_{i}", "schema": schema, "strict": True}}
        greedy = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=48,
                                                temperature=0, response_format=fmt).choices[0]
        jsonschema.validate(json.loads(greedy.message.content), schema)
        sampled = client.completions.create(model="laguna-code-6m", prompt="x = ", max_tokens=48, temperature=1.0,
                                            seed=i, extra_body={"response_format": fmt}).choices[0]
        jsonschema.validate(json.loads(sampled.text), schema)
        assert greedy.finish_reason == sampled.finish_reason == "stop"
    schema = SCHEMAS[12]
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema}}
    expected = _generate(llm, _chat_ids(llm, MESSAGES), max_tokens=48, temperature=0.0, stop=["\n\n\n"],
                         json_schema=schema)
    events = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=48, temperature=0,
                                            response_format=fmt, stream=True)
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected.text
    json_mode = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=48,
                                               temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(json_mode.choices[0].message.content), dict)
    for grammar in ('root ::= ("yes" | "no") [0-9]', 'start: ("yes" | "no") /[0-9]/'):  # GBNF and Lark
        text = client.completions.create(model="laguna-code-6m", prompt="x = ", max_tokens=8,
                                         extra_body={"grammar": grammar}).choices[0].text
        assert text[:-1] in ("yes", "no") and text[-1].isdigit()

    def refused(body):
        code, reply, _ = server.post("/v1/completions", json.dumps({"prompt": "x", **body}).encode())
        assert code == 400, reply
        return reply["error"]["param"]

    def schema_format(**fields):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "n", **fields}}}

    assert refused({"grammar": "start: undefined_rule"}) == "grammar"
    assert refused({"grammar": 'root ::= "a'}) == "grammar"
    assert refused(schema_format(schema={"type": "strnig"})) == "response_format.json_schema.schema"
    assert refused(schema_format(schema={"not": {"type": "null"}})) == "response_format.json_schema.schema"
    assert refused(schema_format(schema=["not", "a", "schema"])) == "response_format.json_schema.schema"
    assert refused(schema_format()) == "response_format.json_schema.schema"
    assert refused(schema_format(schema={}, strict="yes")) == "response_format.json_schema.strict"
    assert refused(schema_format(schema={}, schemas={})) == "response_format.json_schema.schemas"
    assert refused({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}) == (
        "response_format.json_schema.name")
    assert refused({"response_format": {"type": "xml"}}) == "response_format"
    assert refused({"response_format": {"type": "json_object", "schema": {}}}) == "response_format.schema"
    assert refused({"response_format": {"type": "json_object"}, "grammar": 'start: "a"'}) == "grammar"
    # one stop string is one string, not its characters: refused by its name, or kept beside compact JSON
    code, reply, _ = server.post("/v1/completions", json.dumps(
        {"prompt": "x", "max_tokens": 4, "stop": "return", **schema_format(schema={})}).encode())
    assert code == 400 and reply["error"]["param"] == "stop" and "'return'" in reply["error"]["message"], reply
    code, reply, _ = server.post("/v1/completions", json.dumps(
        {"prompt": "x", "max_tokens": 4, "stop": "x\n", **schema_format(schema={})}).encode())
    assert code == 200, reply


def test_the_second_turn_of_a_conversation_reuses_the_cache(server):
    client = server.client()
    first = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=16, temperature=0)
    turn2 = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "def upper(s):"}]
    second = client.chat.completions.create(model="laguna-code-6m", messages=turn2, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # at least all of the first prompt: only the new turn is prefilled
    assert cached < second.usage.prompt_tokens


def test_a_conversation_that_comes_back_after_three_others_finds_its_prefix_cached(server, llm):
    """Four slots (the default --parallel): each new conversation takes the one used least recently,
    so the first one's rows are still there when it comes back, and its answer is a fresh engine's."""
    client = server.client()
    first = [{"role": "user", "content": f"def helper_{i}(items):\n    " + "total = 0\n    " * 6} for i in range(4)]
    answers = [client.chat.completions.create(model="laguna-code-6m", messages=[m], max_tokens=8, temperature=0)
               for m in first]
    back = [first[0], {"role": "assistant", "content": answers[0].choices[0].message.content},
            {"role": "user", "content": "def mean(items):"}]
    reply = client.chat.completions.create(model="laguna-code-6m", messages=back, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens_details.cached_tokens >= answers[0].usage.prompt_tokens
    assert reply.choices[0].message.content == _generate(lucebox.LLM(), _chat_ids(llm, back), max_tokens=8,
                                                         temperature=0.0, stop=["\n\n\n"]).text


def test_faults_get_their_status_codes_and_the_server_goes_on(server):
    body = json.dumps({"model": "laguna-code-6m", "prompt": "x", "max_tokens": 2,
                       "response_format": {"type": "text"}, "tool_choice": "none"}).encode()  # what is done anyway
    cases = [
        (b"{not json", KEY, 400, None),
        (json.dumps({"model": "laguna-code-6m"}).encode(), KEY, 400, "prompt"),
        (json.dumps({"prompt": "x", "max_tokens": "2"}).encode(), KEY, 422, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), KEY, 422, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": True}).encode(), KEY, 422, "temperature"),
        (json.dumps({"prompt": "x", "n": 17}).encode(), KEY, 422, "n"),  # more choices than a request may hold
        # other servers' ways to constrain the output are refused, never ignored with a 200
        (json.dumps({"prompt": "x", "guided_json": {"type": "object"}}).encode(), KEY, 422, "guided_json"),
        (json.dumps({"prompt": "x", "tool_choice": "required"}).encode(), KEY, 422, "tool_choice"),
        # and any field the server does not read (other servers' extensions, a typo)
        (json.dumps({"prompt": "x", "ignore_eos": True}).encode(), KEY, 422, "ignore_eos"),
        (json.dumps({"prompt": "x", "logit_bias": {"100": 101}}).encode(), KEY, 422, "logit_bias"),  # out of range
        (json.dumps({"prompt": "x", "temprature": 0}).encode(), KEY, 422, "temprature"),
        (json.dumps({"prompt": "x", "messages": []}).encode(), KEY, 422, "messages"),
        (json.dumps({"prompt": [1, 99999]}).encode(), KEY, 422, "prompt"),
        (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), KEY, 404, "model"),
        (json.dumps({"prompt": "x" * 70000}).encode(), KEY, 413, None),
        (json.dumps({"prompt": "def f():\n" * 2000}).encode(), KEY, 400, "prompt"),  # past the 4096-token context
        (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", KEY, 400, None),  # an integer json refuses to read
        (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", KEY, 400, None),  # past the reader's 100 characters
        (b"[" * 30000 + b"]" * 30000, KEY, 400, None),  # nesting json cannot follow
        (body, "sk-wrong", 401, None),
    ]
    for data, key, status, param in cases:
        code, reply, _ = server.post("/v1/completions", data, key=key)
        assert code == status, (data[:60], reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param
        if status == 404:
            assert reply["error"]["code"] == "model_not_found"
        if b"def f()" in data:
            assert reply["error"]["code"] == "context_length_exceeded" and "4096 tokens" in reply["error"]["message"]
    code, reply, _ = server.post("/v1/completions", body)
    assert code == 200 and reply["usage"]["completion_tokens"] == 2
    try:  # a wrong method is the client's error, named as such
        urllib.request.urlopen(urllib.request.Request(server.url + "/v1/completions", headers=server.key_header()))
        raise AssertionError("GET /v1/completions answered")
    except urllib.error.HTTPError as e:
        assert e.code == 405 and json.loads(e.read())["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="sk-wrong").models.list()


def _raw(server, data: bytes, close_after_send: bool = False) -> bytes:
    """Bytes sent on a socket of their own, and all the server answers before it closes the connection
    (nothing when the client closes first)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(data)
        if close_after_send:
            return b""
        answer = b""
        while part := conn.recv(65536):
            answer += part
        return answer


def _get(server, path: str, headers: dict) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(server.url + path, headers=headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_hostile_requests_are_refused_and_leave_the_server_answering_as_a_fresh_engine(server, llm):
    def post(body, key=None, **headers):
        code, reply, _ = server.post("/v1/completions", json.dumps(body).encode(), key=key, headers=headers)
        error = reply.get("error", {})
        return code, error.get("param") or error.get("code")

    def chat(messages):
        body = json.dumps({"messages": messages, "max_tokens": 2}).encode()
        code, reply, _ = server.post("/v1/chat/completions", body)
        return code, reply.get("error", {}).get("param")

    request_line = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    declared = request_line + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n".encode() + b'{"prompt"'
    prompt = {"prompt": "x", "max_tokens": 2}
    hostile = {  # what each request gets; the client that leaves is judged by the server's log at the end
        "a client that leaves while sending its body": (lambda: _raw(server, declared, close_after_send=True), b""),
        "a body shorter than its Content-Length": (lambda: _raw(server, declared).split(b"\r\n")[0],
                                                   b"HTTP/1.1 408 Request Timeout"),
        "headers that never end": (lambda: _raw(server, request_line), b""),  # the connection is closed
        "a page rebinding its DNS name": (lambda: post(prompt, Host="attacker.example:8000"),
                                          (403, "host_not_allowed")),
        "a cross-site text/plain POST": (lambda: post(prompt, **{"Content-Type": "text/plain;charset=UTF-8"}),
                                         (415, "unsupported_media_type")),
        "no key": (lambda: post(prompt, key=""), (401, None)),
        "metrics without the key": (lambda: _get(server, "/metrics", {}), 401),
        "a lone surrogate in a message": (lambda: chat([{"role": "user", "content": "def f(\ud800):"}]),
                                          (400, "messages[0].content")),
        "a lone surrogate in a text part": (lambda: chat([{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "\udfff"}]}]),
                                            (400, "messages[0].content[1].text")),
        "a lone surrogate in a prompt": (lambda: post({"prompt": ["x\ud83d"]}), (400, "prompt[0]")),
        "a lone surrogate in a stop string": (lambda: post({**prompt, "stop": ["\n", "\udc00"]}), (400, "stop[1]")),
    }
    for name, (send, expected) in hostile.items():
        assert send() == expected, name
    assert _get(server, "/metrics", server.key_header()) == 200
    prompt = "import sys\n\n\ndef main(argv):\n"
    expected = _generate(llm, prompt, max_tokens=16, temperature=0.0)
    code, reply, _ = server.post("/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 16,
                                                                 "temperature": 0}).encode())
    assert code == 200 and reply["choices"][0]["text"] == expected.text
    assert reply["usage"]["completion_tokens"] == len(expected.token_ids)
    assert "Traceback" not in server.output() and "Exception" not in server.output()


def test_eight_clients_at_once_each_get_their_answer_alone_and_a_client_that_leaves_disturbs_none(server, llm):
    """Four at a time in four slots (the default --parallel), their steps sharing forwards."""
    prompts = [f"def task_{i}(x):\n" for i in range(8)]
    alone = [_generate(llm, p, max_tokens=24, temperature=0.0).text for p in prompts]
    results, errors = [None] * 8, []

    def ask(i):
        try:
            reply = server.client().completions.create(model="laguna-code-6m", prompt=prompts[i], max_tokens=24,
                                                       temperature=0, stream=i % 2 == 0)
            results[i] = "".join(c.choices[0].text for c in reply) if i % 2 == 0 else reply.choices[0].text
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    cancelled, generated = server.metric("requests_cancelled_total"), server.metric("generated_tokens_total")
    leaver = server.client().completions.create(model="laguna-code-6m", prompt="while True:\n", max_tokens=2000,
                                                temperature=0, stream=True)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    next(iter(leaver))
    leaver.close()  # a client that leaves mid-stream: its request stops at the next token
    quiet = socket.create_connection(("127.0.0.1", server.port))  # and one that leaves a request without streaming
    body = json.dumps({"prompt": "for i in range(10):\n", "max_tokens": 2000, "temperature": 0}).encode()
    quiet.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.5)
    quiet.close()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == alone
    deadline = time.time() + 10
    while server.metric("requests_cancelled_total") < cancelled + 2 and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("requests_cancelled_total") == cancelled + 2
    assert server.metric("queue_depth") == 0 and server.metric("generated_tokens_total") >= generated + 8 * 24
    slots = [server.metric(f'slot_requests_total{{slot="{i}"}}') for i in range(4)]  # --parallel 4 by default
    assert sum(slots) >= 10 and all(slots) and server.metric('slot_busy{slot="0"}') == 0
    assert server.metric("batched_forwards_total") > 0  # their steps shared forwards (0: one at a time)


def test_a_full_queue_answers_429_a_drafter_server_is_lossless_and_sigterm_ends_it_cleanly(llm):
    s = Server("--draft", "auto", "--max-queue", "1", "--shutdown-timeout", "1", "--parallel", "1")  # one at a time
    try:
        client = s.client()
        ids = _chat_ids(llm, MESSAGES)
        expected = _generate(llm, ids, max_tokens=40, temperature=0.0, stop=["\n\n\n"]).text
        reply = client.chat.completions.create(model="laguna-code-6m", messages=MESSAGES, max_tokens=40,
                                               temperature=0)
        assert reply.choices[0].message.content == expected
        codes = []
        body = json.dumps({"prompt": "x = 1\n", "max_tokens": 100, "temperature": 0}).encode()

        def post():
            codes.append(s.post("/v1/completions", body))

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        statuses = sorted(code for code, _, _ in codes)
        assert statuses.count(200) >= 2 and 429 in statuses  # one runs, one waits, the rest are turned away
        retry = next(headers for code, _, headers in codes if code == 429)["Retry-After"]
        assert int(retry) >= 1

        long = client.completions.create(model="laguna-code-6m", prompt="while True:\n", max_tokens=3000,
                                         temperature=0, stream=True)
        pieces = iter(long)
        next(pieces)
        started = time.time()
        assert s.stop(sig=signal.SIGTERM) == 0  # in the middle of an answer: cancelled after --shutdown-timeout
        assert time.time() - started < 15
        with pytest.raises(Exception):  # noqa: B017 - the stream ends early, however the client reports it
            for _ in pieces:
                pass
            raise ConnectionError("the stream ended without the answer's 3000 tokens")
    finally:
        if s.proc.poll() is None:
            assert s.stop() == 0


def test_requests_still_running_when_the_shutdown_time_is_up_end_with_503_not_a_cut_connection():
    """SIGTERM with answers running: shortly before --shutdown-timeout ends, each ends with a 503 of
    its own (a whole answer's status, a stream's last event before [DONE]); nothing is cancelled
    under the app (no 500, no traceback)."""
    s = Server("--parallel", "2", "--shutdown-timeout", "2")
    try:
        whole = []
        body = json.dumps({"prompt": "while True:\n", "max_tokens": 4000, "temperature": 0}).encode()
        waiting = threading.Thread(target=lambda: whole.append(s.post("/v1/completions", body)))
        waiting.start()
        stream = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        stream.request("POST", "/v1/completions", json.dumps(
            {"prompt": "while True:\n", "max_tokens": 4000, "temperature": 0, "stream": True}),
            {"Content-Type": "application/json", **s.key_header()})
        answer = stream.getresponse()
        assert answer.status == 200 and answer.readline().startswith(b"data: ")  # it runs
        assert s.stop(sig=signal.SIGTERM) == 0
        events = [line for line in answer.read().decode().split("\n") if line.startswith("data: ")]
        waiting.join(60)
        assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        code, reply, _ = whole[0]
        assert code == 503 and "shutting down" in reply["error"]["message"]
        assert "Exception in ASGI application" not in s.output() and "Traceback" not in s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


@pytest.mark.parametrize("flags, message", [
    (["--max-queue", "0"], "--max-queue must be at least 1, got 0"),
    (["--api-key", ""], "--api-key is empty, which would turn authentication off"),
    (["--api-key", "  "], "--api-key is empty, which would turn authentication off"),
    (["--api-key", "two words"], "--api-key must be printable ASCII without spaces"),
    (["--allowed-host", "http://gpu-box.lan"], "--allowed-host 'http://gpu-box.lan' is not a host name"),
    (["--allowed-host", "gpu-box.lan:8000"], "--allowed-host 'gpu-box.lan:8000' is not a host name"),
    (["--read-timeout", "0"], "--read-timeout must be a positive number of seconds, at most 86400 (a day), got 0.0"),
    # inf used to pass, and Ctrl-C then ended in an OverflowError traceback
    (["--shutdown-timeout", "inf"], "--shutdown-timeout must be a positive number of seconds, at most 86400 (a day), "
                                    "got inf"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a positive number of seconds"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a positive number of seconds"),
    (["--shutdown-timeout", "1e12"], "--shutdown-timeout must be a positive number of seconds"),
    (["--read-timeout", "inf"], "--read-timeout must be a positive number of seconds"),
])
def test_serve_flags_are_checked_before_the_engine_opens(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("lucebox.server.command.open_engine", lambda args: pytest.fail("the engine opened"))
    assert lucebox.cli.main(["serve", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"lucebox: error: {message}")


def _settings(*flags):
    return settings_from(build_parser().parse_args(["serve", *flags]))


def test_a_public_address_without_a_key_is_warned_about():
    with pytest.warns(LuceboxWarning, match="listening on 0.0.0.0 without --api-key: anyone who can reach"):
        _settings("--host", "0.0.0.0")
    with pytest.warns(LuceboxWarning, match="listening on 192.168.1.5 without --api-key"):
        _settings("--host", "192.168.1.5")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _settings("--host", "0.0.0.0", "--api-key", KEY)
        _settings("--host", "127.0.0.2")


@pytest.mark.parametrize("flags, accepted, refused", [
    ([], ["localhost", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST."], ["attacker.example", "10.0.0.5", "", None]),
    (["--allowed-host", "gpu-box.lan", "--allowed-host", "[fd00::1]"], ["gpu-box.lan:80", "[fd00::1]:8000"],
     ["gpu-box.lan.attacker.example", "fd00::1:8000"]),
    (["--host", "10.0.0.5", "--api-key", KEY], ["10.0.0.5:8000", "localhost"], ["10.0.0.6", "box.lan"]),
    # every interface: any IP address (a rebinding page sends its own DNS name), names only as allowed
    (["--host", "0.0.0.0", "--allowed-host", "box.lan"], ["10.0.0.6:8000", "[fe80::1]", "box.lan"],
     ["attacker.example"]),
    (["--host", "::", "--api-key", KEY], ["attacker.example", "10.0.0.6"], ["bad host", None]),  # the key guards
])
def test_the_host_header_must_name_this_server(flags, accepted, refused):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LuceboxWarning)
        guard = HostGuard(None, _settings(*flags))
    assert [h for h in accepted if not guard.accepts(h)] == []
    assert [h for h in refused if guard.accepts(h)] == []


def test_uvicorn_gets_the_connection_limits():
    config = uvicorn_config(None, _settings("--max-connections", "7", "--read-timeout", "2.5", "--port", "9"))
    assert (config.limit_concurrency, config.header_timeout, config.port) == (7, 2.5, 9)
    assert config.http is HeaderDeadlineProtocol and config.timeout_keep_alive == KEEP_ALIVE_SECONDS
