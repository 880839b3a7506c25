"""Reasoning kept apart (`lucebox.text.reasoning`): each template family's thought split from the
answer as it streams, whole and streamed alike; `chat_template_kwargs` and `reasoning_effort` reach the
template's switches; a reasoning budget closes the thought after N tokens; logprobs and max_tokens
count the thought's tokens too."""

import io
import json

import pytest
from reasoning_models import DEEPSEEK_R1, HARMONY, QWEN3, templated_model
from rich.console import Console

import lucebox
from lucebox.chat.conversation import render
from lucebox.cli.chat import _AnswerWriter
from lucebox.constrained.thought_first import answer_rule, thought_first_grammar
from lucebox.errors import InvalidArgumentError
from lucebox.generation import Chunk
from lucebox.server.api_errors import APIError
from lucebox.server.process import ServerProcess
from lucebox.server.reasoning_fields import reasoning_ask
from lucebox.text.call_watch import RepeatedCallWatch
from lucebox.text.reasoning import ReasoningSplit, reasoning_format, split_reasoning, starts_inside
from lucebox.text.tokenizer_files import load_tokenizer

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "Say hi."}]
HARMONY_ANSWER = ("<|channel|>analysis<|message|>User wants a greeting.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>Hi!<|return|>")


@pytest.mark.parametrize("fmt, text, inside, thought, content", [
    ("think", "<think>\nI should greet.\n</think>\n\nHello!", False, "I should greet.", "Hello!"),
    ("think", "I should greet.\n</think>\n\nHello!", True, "I should greet.", "Hello!"),  # DeepSeek-R1
    ("think", "Hello! <think> is a tag", False, None, "Hello! <think> is a tag"),  # no thought: all content
    ("think", "<think>\nstill thinking wh", False, "still thinking wh", ""),  # cut by max_tokens
    ("think", "<think>\n\n</think>\n\nHello!", False, "", "Hello!"),
    ("harmony", HARMONY_ANSWER, False, "User wants a greeting.", "Hi!"),
    ("harmony", "no channels here", False, None, "no channels here"),
    ("harmony", "Hello <|channel|>analysis<|message|>x<|end|>", False, None,  # text first: not harmony
     "Hello <|channel|>analysis<|message|>x<|end|>"),
    ("harmony", "<|channel|>analysis<|message|>x<|end|>Hello there", False, "x", "Hello there"),  # no header
])
def test_each_family_s_thought_is_split_the_same_whole_and_in_any_pieces(fmt, text, inside, thought, content):
    assert split_reasoning(text, fmt, inside) == (thought, content)
    for step in (1, 2, 3, 5):
        split, pieces = ReasoningSplit(fmt, inside), []
        for at in range(0, len(text), step):
            pieces.append(split.push(text[at:at + step]))
        pieces.append(split.finish())
        assert "".join(t for t, _ in pieces) == (thought or "") and "".join(c for _, c in pieces) == content
        if fmt == "think" and thought:  # the thought streams as it comes, never a piece of a marker
            assert all("<" not in t for t, _ in pieces) and sum(1 for t, _ in pieces if t) > 1


def test_the_family_comes_from_the_template_and_the_prompt_says_whether_the_answer_starts_inside():
    assert [reasoning_format(t) for t in (QWEN3, DEEPSEEK_R1, HARMONY, "{{ messages }}", None)] == [
        "think", "think", "harmony", None, None]
    assert starts_inside("think", "<|Assistant|><think>\n") and not starts_inside("think", "<|im_start|>assistant\n")


def test_reasoning_fields_map_to_the_template_s_switches_or_a_budget():
    assert reasoning_ask({"grammar": "start: x"}, "think", DEEPSEEK_R1, 0).budget is None  # the grammar covers it
    kept = reasoning_ask({"reasoning_budget": 0, "chat_template_kwargs": {"enable_thinking": True}}, "think", QWEN3, -1)
    assert (kept.variables, kept.budget) == ({"enable_thinking": True}, 0)  # the switch asked on: the budget holds
    assert reasoning_ask({"reasoning_effort": "none"}, "think", QWEN3, -1).variables == {
        "reasoning_effort": "none", "enable_thinking": False}
    ask = reasoning_ask({"reasoning_effort": "none"}, "think", DEEPSEEK_R1, -1)  # no switch: a budget of 0
    assert (ask.variables, ask.budget) == ({"reasoning_effort": "none"}, 0)
    assert reasoning_ask({}, "think", DEEPSEEK_R1, 0).budget == 0  # the server's --reasoning-budget
    assert reasoning_ask({"reasoning_budget": -1}, "think", DEEPSEEK_R1, 0).budget is None
    assert reasoning_ask({"reasoning_budget": 0}, "think", QWEN3, -1).variables == {"enable_thinking": False}
    assert reasoning_ask({"reasoning_effort": "high"}, "harmony", HARMONY, -1).variables == {"reasoning_effort": "high"}
    for body, fmt in (({"reasoning_effort": "low"}, None), ({"reasoning_effort": "none"}, "harmony"),
                      ({"reasoning_budget": 0}, "harmony"), ({"reasoning_budget": 0}, None),
                      ({"reasoning_effort": "low"}, "think")):  # Qwen3's template has no effort setting
        with pytest.raises(APIError) as refused:
            reasoning_ask(body, fmt, "", -1)
        assert (refused.value.status, refused.value.param) == (400, next(iter(body)))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = {name: ServerProcess(str(templated_model(tmp_path_factory.mktemp(name) / "model", template)),
                                   "--served-model-name", "m", *flags)
               for name, template, flags in (("qwen3", QWEN3, ()), ("r1", DEEPSEEK_R1, ()), ("harmony", HARMONY, ()),
                                             ("qwen3_raw", QWEN3, ("--reasoning-format", "none")))}
    yield {name: openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0) for name, s in started.items()}
    for s in started.values():
        assert s.stop() == 0
        assert "Traceback" not in s.output()


def _ask(client, stream=False, **fields):
    extra = {k: fields.pop(k) for k in ("grammar", "reasoning_budget", "chat_template_kwargs") if k in fields}
    reply = client.chat.completions.create(model="m", messages=MESSAGES, stream=stream, extra_body=extra,
                                           **{"max_tokens": 40, "temperature": 0, **fields})
    if not stream:
        choice = reply.choices[0]
        return getattr(choice.message, "reasoning_content", None), choice.message.content, choice.finish_reason, reply
    thought, content, finish, events = None, "", None, list(reply)
    for e in events:
        delta = e.choices[0].delta
        if getattr(delta, "reasoning_content", None) is not None:
            thought = (thought or "") + delta.reasoning_content
        content += delta.content or ""
        finish = e.choices[0].finish_reason or finish
    return thought, content, finish, events


@pytest.mark.parametrize("server, answer, thought, content", [
    ("qwen3", "<think>\nI should greet.\n</think>\n\nHello!", "I should greet.", "Hello!"),
    ("qwen3", "<think>\n\n</think>\n\nHello!", "", "Hello!"),  # an empty thought: "" in both
    ("r1", "I should greet.\n</think>\n\nHello!", "I should greet.", "Hello!"),
    ("harmony", HARMONY_ANSWER.removesuffix("<|return|>"), "User wants a greeting.", "Hi!"),
])
def test_each_family_answers_reasoning_content_apart_through_the_openai_client(servers, server, answer, thought,
                                                                               content):
    grammar = "start: " + json.dumps(answer)
    for stream in (False, True):
        assert _ask(servers[server], stream, grammar=grammar, max_tokens=150)[:3] == (thought, content, "stop")
    events = _ask(servers[server], True, grammar=grammar, max_tokens=150)[3]
    if thought:
        assert sum(1 for e in events if getattr(e.choices[0].delta, "reasoning_content", None)) > 1  # as it comes


def test_enable_thinking_false_and_reasoning_effort_reach_the_template(servers, tmp_path):
    thinking = _ask(servers["qwen3"], max_tokens=12)
    off = _ask(servers["qwen3"], max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert off[3].usage.prompt_tokens > thinking[3].usage.prompt_tokens  # the empty <think></think> in the prompt
    assert off[0] is None and off[1] != thinking[1]  # no thought: the model answers at once
    assert _ask(servers["qwen3"], max_tokens=12, reasoning_effort="none")[:3] == off[:3]
    assert _ask(servers["harmony"], max_tokens=4, reasoning_effort="high")[2] == "length"  # served
    tokenizer = load_tokenizer(templated_model(tmp_path / "harmony", HARMONY), {}, None)
    variables = reasoning_ask({"reasoning_effort": "high"}, "harmony", HARMONY, -1).variables
    assert "Reasoning: high" in render(tokenizer, MESSAGES, True, None, variables)  # gpt-oss's switch
    assert "Reasoning: medium" in render(tokenizer, MESSAGES, True)


SMALL_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}


def test_a_reasoning_budget_closes_the_thought_after_that_many_tokens(servers):
    unbounded = _ask(servers["r1"], max_tokens=40)  # the built-in model never closes its thought itself
    assert unbounded[0] and unbounded[1] == "" and unbounded[2] == "length"
    for stream in (False, True):
        thought, content, _, _ = _ask(servers["r1"], stream, max_tokens=40, reasoning_budget=6)
        assert thought == unbounded[0][:len(thought)] and len(thought) < len(unbounded[0])
        assert content  # after the forced </think>, the model answers
        none = _ask(servers["r1"], stream, max_tokens=20, reasoning_budget=0)
        assert none[0] == "" and none[1]  # the close forced at once
        assert _ask(servers["r1"], stream, max_tokens=20, reasoning_effort="none")[:3] == none[:3]
    tokens = [t.token for t in _ask(servers["r1"], max_tokens=40, reasoning_budget=6, logprobs=True)[3]
              .choices[0].logprobs.content]
    assert "".join(tokens[:6]).count("</") == 0 and "".join(tokens).count("</think>") == 1  # 6 thought tokens
    assert _ask(servers["qwen3"], max_tokens=12, reasoning_budget=0)[:3] == _ask(
        servers["qwen3"], max_tokens=12, chat_template_kwargs={"enable_thinking": False})[:3]  # the switch
    for stream in (False, True):  # a bound before a constrained answer: the thought closed, then the JSON
        thought, content, finish, _ = _ask(servers["r1"], stream, max_tokens=60, reasoning_budget=6,
                                           response_format=SMALL_SCHEMA)
        assert thought == unbounded[0][:len(thought)] and len(thought) < len(unbounded[0])
        assert finish == "stop" and set(json.loads(content)) == {"ok"}


def test_logprobs_and_max_tokens_count_the_thought_too(servers):
    thought, content, finish, reply = _ask(servers["r1"], max_tokens=15, logprobs=True)
    assert finish == "length" and reply.usage.completion_tokens == 15 == len(reply.choices[0].logprobs.content)
    assert "".join(t.token for t in reply.choices[0].logprobs.content).lstrip().startswith(thought)
    for budget in (0, 5):  # the forced close is counted too
        bounded = _ask(servers["r1"], max_tokens=15, logprobs=True, reasoning_budget=budget)[3]
        assert bounded.usage.completion_tokens == 15 == len(bounded.choices[0].logprobs.content)


def test_a_chat_keeps_the_thought_apart_and_the_template_drops_it_from_later_turns(tmp_path):
    llm = lucebox.LLM(str(templated_model(tmp_path / "qwen3", QWEN3)), draft=None)
    chat = llm.chat(temperature=0.0, max_tokens=40, grammar='start: "<think>\\nI should greet.\\n</think>\\n\\nHello!"')
    chunks = list(chat.stream("Say hi."))
    assert "".join(c.reasoning or "" for c in chunks) == "I should greet."
    assert "".join(c.text or "" for c in chunks) == "Hello!" and sum(1 for c in chunks if c.reasoning) > 1
    assert chat.messages[-1] == {"role": "assistant", "content": "Hello!", "reasoning_content": "I should greet."}
    reply = chat.send("Again.")
    assert (reply.reasoning, reply.text) == ("I should greet.", "Hello!")
    shown = llm.tokenizer.decode(chat.last_prompt_ids)
    assert "Hello!" in shown and "I should greet." not in shown  # this template drops past thoughts
    chat.save(tmp_path / "chat.json")
    again = llm.chat()
    again.load(tmp_path / "chat.json")
    assert again.messages[1]["reasoning_content"] == "I should greet."  # saved and loaded with the answer


def test_the_chat_prints_a_thought_dimmed_then_the_answer():
    out = Console(file=io.StringIO(), force_terminal=True)
    writer = _AnswerWriter(out)
    for reasoning, text in (("I should", ""), (" greet.", ""), ("", "Hello"), ("", "!")):
        writer.write(Chunk([], text, reasoning=reasoning or None))
    writer.end()
    assert out.file.getvalue() == "\x1b[2mI should greet.\x1b[0m\n\nHello!\n"
    plain = Console(file=io.StringIO(), force_terminal=False)
    writer = _AnswerWriter(plain)
    writer.write(Chunk([], "", reasoning="hm"))
    writer.write(Chunk([], "Hi"))
    writer.end()
    assert plain.file.getvalue() == "hm\n\nHi\n"


def test_a_constrained_answer_comes_after_the_thought_not_instead_of_it(servers):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    free = _ask(servers["r1"], max_tokens=30)
    for stream in (False, True):  # the built-in model never closes its thought: it stays its own, never JSON
        assert _ask(servers["r1"], stream, max_tokens=30, response_format=response_format)[:3] == free[:3]
        # gpt-oss: the model opens its analysis channel and stays in it (the final one would be JSON)
        thought, content, finish = _ask(servers["harmony"], stream, max_tokens=30, response_format=response_format)[:3]
        assert (len(thought) > 10, content, finish) == (True, "", "length")
    tools = [{"type": "function", "function": {"name": "greet", "parameters": schema}}]
    reply = servers["r1"].chat.completions.create(model="m", messages=MESSAGES, tools=tools, tool_choice="required",
                                                  max_tokens=30, temperature=0)
    assert reply.choices[0].message.reasoning_content == free[0]
    # a model that closes its thought (here the close is "yield", which the built-in model writes early):
    # the answer after it follows the schema
    grammar = thought_first_grammar(True, None, answer_rule(schema), markers=("<think>", "yield"))
    text = lucebox.LLM(draft=None).generate("def f(x):", max_tokens=30, temperature=0.0, grammar=grammar).text
    thought, _, answer = text.partition("yield")
    assert thought.strip() == "" or "yield" not in thought
    assert json.loads(answer) in ({"ok": True}, {"ok": False})


def test_crafted_reasoning_fields_are_refused_naming_them_never_a_500(servers):
    n = 396  # a schema of 397 $refs: within the bounds alone, past them beside a thought in one grammar
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)} | {f"d{n}": {"type": "integer"}}
    deep = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}
    for fields, status, param in (({"chat_template_kwargs": {"self": 1}}, 422, "chat_template_kwargs.self"),
                                  ({"reasoning_budget": 10**30}, 422, "reasoning_budget"),
                                  ({"response_format": deep}, 400, "response_format")):
        with pytest.raises(openai.APIStatusError) as refused:
            _ask(servers["r1"], max_tokens=4, **fields)
        assert (refused.value.status_code, refused.value.body["param"]) == (status, param), fields


def test_calls_written_inside_the_thought_neither_count_nor_end_the_answer():
    call = '{"name": "f", "arguments": {}}'
    block = f"<tool_call>\n{call}\n</tool_call>"
    text = f"<think>\nI could write {block} or {block}\n</think>\n\n{block}\n{block}"

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(text[i] for i in ids)

    def ends_at(thought):
        watch = RepeatedCallWatch(Chars(), "hermes", (), *thought)
        return next((i for i in range(len(text)) if watch.push([i])), None)

    assert ends_at(("think", False)) == len(text) - 1  # the answer's own second call
    assert ends_at((None, False)) < text.index("</think>")  # read as content, the thought's calls would end it
    after = "I should call f.\n</think>\n\n" + '{"tool_calls": [' + ", ".join([call] * 3) + "]}"
    watch = RepeatedCallWatch(type("T", (), {"decode": lambda self, ids, skip_special_tokens=True: "".join(
        after[i] for i in ids)})(), "json", (), "think", True)
    assert any(watch.push([i]) for i in range(len(after)))  # R1: the prompt opened the thought


def test_reasoning_format_none_keeps_the_thought_in_content_and_the_switches_working(servers):
    answer = "<think>\nI should greet.\n</think>\n\nHello!"
    for stream in (False, True):
        assert _ask(servers["qwen3_raw"], stream, grammar="start: " + json.dumps(answer))[:3] == (None, answer, "stop")
    off = _ask(servers["qwen3_raw"], max_tokens=12, reasoning_effort="none")
    assert off[:3] == _ask(servers["qwen3_raw"], max_tokens=12, chat_template_kwargs={"enable_thinking": False})[:3]


def test_a_thought_budget_is_lossless_under_speculation_and_checked(builtin_llm):
    options = dict(max_tokens=30, temperature=0.0, thought_syntax="think", starts_in_thought=True, thought_budget=4)
    drafted = builtin_llm.generate("def f(x):", **options)  # the built-in model's DFlash drafter on
    plain = lucebox.LLM(draft=None).generate("def f(x):", **options)
    assert drafted.token_ids == plain.token_ids and "</think>" in drafted.text
    for bad in ({"thought_syntax": None}, {"json_object": True}, {"thought_budget": 0}):
        with pytest.raises(InvalidArgumentError):
            lucebox.RequestOptions.from_keywords(**{**options, **bad})
