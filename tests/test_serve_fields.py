"""`lucebox serve` and OpenAI's request fields: the ones that mean nothing to a local server are accepted
(type-checked, ignored), the ones that would change the output in ways lucebox cannot are refused by
name with the reason; logit_bias is served as LLM.generate serves it; echo writes back a token-id
prompt as text; a request head over 16 KiB gets 431 however it arrives."""

import json
import socket

import pytest

import lucebox
from lucebox.chat.conversation import encode_all, render
from lucebox.chat.settings import model_defaults
from lucebox.server.process import ServerProcess

openai = pytest.importorskip("openai")

PROMPT = "def merge(left, right):\n"
MESSAGES = [{"role": "user", "content": "def reverse(s):"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess()
    yield s
    assert s.stop() == 0
    assert "Traceback" not in s.output()


@pytest.fixture(scope="module")
def llm():
    return lucebox.LLM()


def _post(server, path, body):
    code, reply, _ = server.post(path, json.dumps(body).encode())
    return code, reply


def _greedy(llm, prompt, **options):
    """LLM.generate as the server runs a greedy request (the model's generation_config under it)."""
    return llm.generate(prompt, **{**model_defaults(llm.description.generation_config), "temperature": 0.0,
                                   **options})


NO_OPS = {"metadata": {"team": "search", "run": "7"}, "store": False, "service_tier": "auto",
          "prompt_cache_key": "user-42", "prompt_cache_retention": "24h", "prompt_cache_options": {},
          "safety_identifier": "hash-of-user", "user": "u-1", "modalities": ["text"]}


def test_openai_s_no_op_fields_are_accepted_and_change_nothing(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    plain = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    code, reply = _post(server, "/v1/chat/completions", plain)
    assert code == 200
    want = reply["choices"][0]["message"]["content"]
    got = client.chat.completions.create(
        model=reply["model"], **plain, metadata=NO_OPS["metadata"], store=False, service_tier="auto",
        prompt_cache_key="user-42", safety_identifier="hash-of-user", user="u-1", modalities=["text"],
        extra_body={"prompt_cache_retention": "24h", "prompt_cache_options": {}})
    assert got.choices[0].message.content == want
    stream = client.chat.completions.create(model=reply["model"], **plain, stream=True,
                                            stream_options={"include_usage": True, "include_obfuscation": False})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    code, reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    code2, reply2 = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                      "user": "u-1"})
    assert code == code2 == 200 and reply2["choices"][0]["text"] == reply["choices"][0]["text"]


@pytest.mark.parametrize("path, field, value, message", [
    ("/v1/chat/completions", "metadata", {"run": 7}, "must be an object of strings"),
    ("/v1/chat/completions", "metadata", ["a"], "must be an object of strings"),
    ("/v1/chat/completions", "store", "yes", "must be true or false"),
    ("/v1/chat/completions", "service_tier", 1, "must be a string"),
    ("/v1/chat/completions", "prompt_cache_key", {}, "must be a string"),
    ("/v1/completions", "user", 5, "must be a string"),
    ("/v1/chat/completions", "stream_options", {"include_obfuscation": "no"}, "must be true or false"),
    ("/v1/chat/completions", "stream_options", {"continuous_usage_stats": True}, "is not served"),
    # what would change the output, refused with why
    ("/v1/chat/completions", "reasoning_effort", "max", "must be one of"),
    ("/v1/chat/completions", "reasoning_budget", -2, "-1 (no bound)"),
    ("/v1/chat/completions", "chat_template_kwargs", ["x"], "must be an object"),
    ("/v1/chat/completions", "chat_template_kwargs", {"messages": []}, "the server sets it"),
    ("/v1/chat/completions", "verbosity", "low", "is not supported"),
    ("/v1/chat/completions", "modalities", ["text", "audio"], "text only"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}, "no audio"),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}, "not implemented"),
    ("/v1/chat/completions", "web_search_options", {}, "does not search the web"),
    ("/v1/chat/completions", "moderation", {}, "no moderation"),
    ("/v1/completions", "suffix", "\n    return s", "fill-in-the-middle"),
    ("/v1/completions", "metadata", {"a": "b"}, "is not a field lucebox's completion endpoint serves"),
])
def test_bad_or_unservable_fields_get_422_naming_them(server, path, field, value, message):
    body = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    code, reply = _post(server, path, {**body, "max_tokens": 2, field: value})
    param = f"{field}.{next(iter(value))}" if isinstance(value, dict) and field in (
        "stream_options", "chat_template_kwargs") else field
    assert (code, reply["error"]["param"]) == (422, param)
    assert message in reply["error"]["message"]


def test_logit_bias_is_served_as_llm_generate_serves_it(server, llm):
    unbiased = _greedy(llm, PROMPT, max_tokens=12).token_ids
    bias = {unbiased[2]: -100, 13: 2.5}
    want = _greedy(llm, PROMPT, max_tokens=12, logit_bias=bias)
    assert want.token_ids != unbiased and unbiased[2] not in want.token_ids
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logit_bias": {str(k): v for k, v in bias.items()}}
    code, reply = _post(server, "/v1/completions", body)
    assert code == 200 and reply["choices"][0]["text"] == want.text
    assert reply["usage"]["completion_tokens"] == len(want.token_ids)
    ids = encode_all(llm.tokenizer, render(llm.tokenizer, MESSAGES, add_generation_prompt=True))
    forced = _greedy(llm, ids, max_tokens=6, logit_bias={97: 100}, ignore_eos=True)
    code, reply = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0,
                                                         "logit_bias": {"97": 100}})
    assert code == 200 and reply["choices"][0]["message"]["content"] == forced.text == llm.tokenizer.decode([97] * 6)


@pytest.mark.parametrize("bias, message", [
    ({"abc": 1}, "key 'abc' is not a token id"),
    ({"-1": 1}, "key '-1' is not a token id"),
    ({"9" * 5000: 1}, "key '99999999999999999999' is not a token id"),  # never handed to int(): 4,300 digits raise
    ({"4096": 1}, "logit_bias token id must be in 0..4095, got 4096"),
    ({"7": 101}, "logit_bias[7] must be in [-100.0, 100.0], got 101"),
    ({"7": "1"}, "the bias of 7 must be a number"),
    ({"7": True}, "the bias of 7 must be a number"),
    ([7], "must be an object of token ids to biases"),
    ({str(i): 1 for i in range(301)}, "logit_bias may bias at most 300 tokens, got 301"),
])
def test_bad_logit_biases_get_422_naming_logit_bias(server, bias, message):
    code, reply = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logit_bias": bias})
    assert (code, reply["error"]["param"]) == (422, "logit_bias") and message in reply["error"]["message"]


def test_echo_writes_back_a_token_id_prompt_as_text(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
    _, plain = _post(server, "/v1/completions", body)
    code, echoed = _post(server, "/v1/completions", {**body, "echo": True})
    assert code == 200 and echoed["choices"][0]["text"] == text + plain["choices"][0]["text"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model=echoed["model"], **body, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == echoed["choices"][0]["text"]
    # with n choices each begins with the prompt, streamed or whole
    code, two = _post(server, "/v1/completions", {**body, "echo": True, "n": 2})
    assert code == 200 and [c["text"][: len(text)] for c in two["choices"]] == [text, text]
    streamed = ["", ""]
    for c in client.completions.create(model=echoed["model"], **body, echo=True, n=2, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c["text"] for c in two["choices"]]


def _head(server, header_bytes: int) -> bytes:
    """The server's whole answer to a completion whose one extra header holds `header_bytes` bytes, all
    sent at once (read until the server closes the connection); b"reset" when it closed the connection
    before reading all that was sent (the kernel then resets it, and the answer may be lost)."""
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nX-Pad: {'a' * header_bytes}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        answer = b""
        try:
            conn.sendall(head + body)
            while part := conn.recv(65536):
                answer += part
        except (ConnectionResetError, BrokenPipeError):
            return b"reset"
    return answer


def test_a_request_head_over_16_kib_gets_431_however_it_arrives(server):
    assert _head(server, 15_000).startswith(b"HTTP/1.1 200 ")
    answer = _head(server, 20_000)  # whole in one read: h11 alone served it
    assert answer.startswith(b"HTTP/1.1 431 ") and b"request_header_fields_too_large" in answer
    assert b"16384 bytes" in answer and answer.endswith(b"}")  # and the connection closed
    for size in (60_000, 300_000):  # in one read or several, as the kernel hands them over
        answer = _head(server, size)
        assert answer.startswith(b"HTTP/1.1 431 ") or answer == b"reset", size
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:  # a head still coming
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 17_000)
        assert conn.recv(65536).startswith(b"HTTP/1.1 431 ")
    code, _ = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert code == 200  # and the server goes on
