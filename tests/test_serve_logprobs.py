"""logprobs, n choices and presence/frequency penalties through `lucebox serve` and the official
`openai` client: logprobs equal log_softmax of `LLM.logits`, n choices count the prompt once and
reuse its cache, penalties give `LLM.generate`'s tokens, and out-of-range fields get 422s."""

import json

import pytest
import torch

import lucebox
from lucebox.chat.conversation import encode_all, render
from lucebox.chat.settings import model_defaults
from lucebox.server.logprobs_format import TokenText
from lucebox.server.process import ServerProcess

openai = pytest.importorskip("openai")
KEY = "sk-lucebox-test"
MODEL = "laguna-code-6m"
MESSAGES = [{"role": "system", "content": "# list helpers"}, {"role": "user", "content": "def flatten(xs):"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--dtype", "float32", api_key=KEY)  # float32 on a GPU too: logprobs to 1e-5
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return lucebox.LLM(dtype="float32")  # as the server opens it


def _generate(llm, prompt, **options):
    """LLM.generate with the sampling defaults the server applies under the request's."""
    return llm.generate(prompt, **{**model_defaults(llm.description.generation_config), **options})


def _log_softmax(llm, prompt_ids, generated):
    return torch.log_softmax(llm.logits(prompt_ids + generated).float(), -1)[len(prompt_ids) - 1 : -1]


def test_logprobs_through_the_official_client_equal_log_softmax_of_llm_logits(client, llm):
    ids = encode_all(llm.tokenizer, render(llm.tokenizer, MESSAGES, add_generation_prompt=True))
    expected = _generate(llm, ids, max_tokens=12, temperature=0.0)
    ref = _log_softmax(llm, ids, expected.token_ids)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t], skip_special_tokens=False)
                                          for t in expected.token_ids]
    for c, row, token in zip(content, ref, expected.token_ids, strict=True):
        assert abs(c.logprob - row[token].item()) < 1e-5 and c.bytes == list(c.token.encode())
        values, top = row.topk(3)
        assert [t.token for t in c.top_logprobs][0] == llm.tokenizer.decode([int(top[0])], skip_special_tokens=False)
        assert torch.allclose(torch.tensor([t.logprob for t in c.top_logprobs]), values, atol=1e-5)
    events = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for e in events if e.choices and e.choices[0].logprobs for c in e.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]  # logprobs within float32 rounding: a
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content, strict=True)) < 1e-5  # round's width


    prompt = "def chunks(xs, n):\n"
    expected = _generate(llm, prompt, max_tokens=10, temperature=0.0)
    ref = _log_softmax(llm, llm.tokenizer.encode(prompt), expected.token_ids)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2).choices[0]
    assert "".join(text.logprobs.tokens) == text.text == expected.text
    assert text.logprobs.text_offset == [len("".join(text.logprobs.tokens[:i])) for i in range(10)]
    for logprob, top, row, token in zip(text.logprobs.token_logprobs, text.logprobs.top_logprobs, ref,
                                        expected.token_ids, strict=True):
        assert abs(logprob - row[token].item()) < 1e-5 and len(top) == 2
        assert abs(max(top.values()) - row.max().item()) < 1e-5


def test_n_choices_count_the_prompt_once_reuse_its_cache_and_repeat_with_a_seed(server, client, llm):
    ids = encode_all(llm.tokenizer, render(llm.tokenizer, MESSAGES, add_generation_prompt=True))
    cached_before = server.metric("cached_prompt_tokens_total")

    def ask(**options):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0,
                                              seed=5, logprobs=True, **options)

    reply = ask(n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    assert server.metric("cached_prompt_tokens_total") - cached_before >= 2 * (len(ids) - 1)  # choices 1, 2
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1 and [c.message.content for c in ask(n=3).choices] == texts
    assert ask().choices[0].message.content == texts[0]  # choice 0 has the request's own seed
    events = list(ask(n=2, stream=True, stream_options={"include_usage": True}))
    for i in (0, 1):
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices and e.choices[0].index == i) \
            == texts[i]
    assert events[-1].usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices[:2])


def test_presence_and_frequency_penalties_through_the_server_are_llm_generate_s(client, llm):
    prompt = "def repeat(s):\n"
    options = {"max_tokens": 12, "temperature": 0.0, "presence_penalty": 1.2, "frequency_penalty": 0.7}
    expected = _generate(llm, prompt, **options).text
    assert expected != _generate(llm, prompt, max_tokens=12, temperature=0.0).text
    assert client.completions.create(model=MODEL, prompt=prompt, **options).choices[0].text == expected


def test_out_of_range_fields_get_422s_naming_them(server):
    cases = [
        ("/v1/completions", {"n": 17}, "n"), ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": 1, "echo": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as OpenAI
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ]
    for path, fields, param in cases:
        body = {"messages": MESSAGES} if "chat" in path else {"prompt": "x"}
        code, reply, _ = server.post(path, json.dumps({**body, "max_tokens": 2, **fields}).encode())
        assert (code, reply["error"]["param"]) == (422, param), fields


def test_a_token_s_text_keeps_the_leading_space_a_decoder_drops_at_the_start_of_a_text():
    class StrippingTokenizer:  # as a tokenizer.json with a `Strip` decoder (Llama 2's)
        pieces = {0: " a", 1: " b", 2: "\u2581"}

        def encode(self, text, add_special_tokens=True):
            return [0]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids).removeprefix(" ")

    text = TokenText(StrippingTokenizer())
    assert (text(1), text(2)) == (" b", "\u2581")
    assert TokenText(None)(7) == "token_id:7"
