"""`LLM.chat` sessions: each turn prefills only its own tokens, the answers are the ones plain
generation gives on the same context, and a saved conversation loads back to the same state."""

import io
import json
import os

import pytest
from rich.console import Console

import lucebox
import lucebox.chat.saved_chat
from lucebox.chat.conversation import encode_all, render
from lucebox.chat.slash_commands import ChatCommands
from lucebox.errors import ContextLengthError, InvalidArgumentError
from lucebox.output import OutputExistsError


@pytest.fixture(scope="module")
def builtin():
    # Plain decoding: the default drafter's width follows the clock, and float32 verify blocks of other
    # widths round differently, so its greedy tokens could differ from run to run on a loaded machine.
    return lucebox.LLM(draft=None)


@pytest.fixture(scope="module")
def builtin_drafted():
    return lucebox.LLM(draft="auto", adaptive=False)  # fixed width: it drafts every round, whatever the clock says


def _plain_answer(llm, context_ids, max_tokens):
    """What plain greedy generation gives on the same context, from an empty cache."""
    llm.drop_cache()
    return llm.generate(context_ids, max_tokens=max_tokens, temperature=0.0, stop=["\n\n\n"]).token_ids


@pytest.mark.parametrize("engine", ["builtin", "builtin_drafted"])
def test_each_turn_prefills_only_its_own_tokens_and_answers_as_plain_generation(engine, request, builtin):
    llm = request.getfixturevalue(engine)
    chat = llm.chat(temperature=0.0, max_tokens=40)
    first = chat.send("def parse(text):")
    held = chat.context_tokens
    second = chat.send("class Point:")
    stats = second.stats
    # everything the first turn left in the context is reused; only the new turn is prefilled
    assert stats["cached_prompt_tokens"] >= held - 1
    assert stats["prompt_tokens"] - stats["cached_prompt_tokens"] <= stats["prompt_tokens"] - held + 1
    if engine == "builtin_drafted":
        assert stats["rounds"] < stats["generated_tokens"]  # the drafter was used (and was right sometimes)
    # the answer is the target's own: plain decoding from scratch on the same context gives it
    assert _plain_answer(builtin, chat.last_prompt_ids, 40) == second.token_ids
    assert [m["role"] for m in chat.history] == ["user", "assistant", "user", "assistant"]
    assert chat.history[1]["content"] == first.text


def test_a_cut_answer_stays_in_the_history_and_the_next_turn_reuses_the_cache(builtin):
    chat = builtin.chat(temperature=0.0, max_tokens=200)
    stream = chat.stream("def main():")
    chunks = [next(stream) for _ in range(3)]
    stream.close()
    said = "".join(c.text for c in chunks)
    assert chat.history[-1] == {"role": "assistant", "content": said, "cut": True}
    # its figures up to the cut, marked as cut (what /stats shows after Ctrl-C)
    stats = chat.last_stats
    assert stats["cut"] is True and stats["generated_tokens"] == sum(len(c.token_ids) for c in chunks)
    assert stats["prompt_tokens"] == len(chat.last_prompt_ids) and stats["decode_tokens_per_s"] > 0
    shown = Console(file=io.StringIO(), width=200)
    ChatCommands(chat, shown, shown).run("/stats")
    assert "cut short" in shown.file.getvalue() and "tokens/s" in shown.file.getvalue()
    held = chat.context_tokens
    g = chat.send("import os", max_tokens=8)
    assert g.stats["cached_prompt_tokens"] >= held - 1
    assert _plain_answer(builtin, chat.last_prompt_ids, 8) == g.token_ids


def test_save_then_load_round_trips_the_conversation_and_its_next_answer(builtin, tmp_path):
    chat = builtin.chat(system="# utilities\n", temperature=0.0, max_tokens=24)
    chat.send("def clamp(x, lo, hi):")
    chat.send("def mean(xs):")
    chat.save(tmp_path / "a.json")
    expected = chat.send("def median(xs):", max_tokens=12)

    other = lucebox.LLM().chat()
    other.load(tmp_path / "a.json")
    assert other.history == chat.history[:5] and other.system == "# utilities\n"
    other.save(tmp_path / "b.json")
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    loaded = other.context_tokens
    again = other.send("def median(xs):", max_tokens=12)
    assert again.token_ids == expected.token_ids
    assert again.stats["cached_prompt_tokens"] >= loaded - 1  # /load prefilled it: the turn reuses it


def test_save_refuses_an_existing_file_unless_told_and_a_failed_write_leaves_it(builtin, tmp_path, monkeypatch):
    chat = builtin.chat(temperature=0.0, max_tokens=4)
    path = tmp_path / "chat.json"
    path.write_text("mine")
    with pytest.raises(OutputExistsError, match="already exists"):
        chat.save(path)
    assert path.read_text() == "mine"
    chat.send("def f(x):")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", full_disk)
        with pytest.raises(InvalidArgumentError, match="No space left"):
            chat.save(path, overwrite=True)
    assert path.read_text() == "mine" and os.listdir(tmp_path) == ["chat.json"]  # no temporary file left
    chat.save(path, overwrite=True)
    assert len(json.loads(path.read_text())["messages"]) == 2


def test_a_chat_template_model_grows_its_context_by_the_template_s_new_text(text_model):
    chat = text_model.chat(temperature=0.0, max_tokens=6)
    chat.send("hello world")
    before = list(chat.context.ids)
    g = chat.send("the quick brown fox")
    assert g.stats["prompt_tokens"] > len(before)
    assert chat.context.ids[: len(before)] == before  # the context only grows: nothing is re-tokenized
    # the first answer (cut by max_tokens) was closed by the template's </s>; the turn added the user's
    # message and the assistant header; then come the answer's own tokens
    tok = text_model.tokenizer
    assert before[-1] == tok.token_to_id("</s>")
    added = chat.context.ids[len(before): g.stats["prompt_tokens"]]
    assert added == tok.encode_continuation("<s>user: the quick brown fox</s><s>assistant:")
    assert chat.context.ids[g.stats["prompt_tokens"]:][: len(g.token_ids)] == g.token_ids
    assert chat.context.rendered == tok.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in chat.history], add_generation_prompt=False)


def test_bad_settings_and_files_are_typed_errors(builtin, tmp_path):
    chat = builtin.chat()
    for bad in ({"temperature": -1.0}, {"top_p": 2.0}, {"max_tokens": 0}, {"seed": "x"}, {"stop": "abc"},
                {"warmth": 1}, {"top_k": 1.5}, {"temperature": "hot"}):
        with pytest.raises(InvalidArgumentError):
            chat.set(**bad)
    (tmp_path / "x.json").write_text('{"hello": 1}')
    (tmp_path / "typo.json").write_text(json.dumps({"format": "lucebox-chat", "messages": [],
                                                    "settings": {"max_token": 8}}))
    for path in (tmp_path / "x.json", tmp_path / "missing.json", tmp_path / "typo.json"):
        with pytest.raises(InvalidArgumentError):
            chat.load(path)
    with pytest.raises(InvalidArgumentError):
        chat.send(["not", "text"])
    with pytest.raises(InvalidArgumentError):
        chat.send("x", temprature=0.5)
    assert chat.history == []


def test_a_chat_with_a_schema_as_deep_as_a_schema_may_be_saves_and_loads_back(builtin, tmp_path):
    """The file wraps the schema in two more levels (settings.json_schema): it is read within 110, so
    whatever a chat takes, its saved file gives back (a review found a 100-deep schema refused on /load)."""
    schema = {"type": "string"}
    for _ in range(98):  # 99 levels of objects, the file's two more past 100
        schema = {"type": "array", "items": schema}
    chat = builtin.chat(json_schema=schema, max_tokens=2)
    chat.save(tmp_path / "deep.json")
    builtin.chat().load(tmp_path / "deep.json")


def test_a_chat_file_that_is_not_one_is_a_typed_error_and_read_within_bounds(builtin, tmp_path, monkeypatch):
    chat = builtin.chat(temperature=0.0, max_tokens=4)
    chat.send("def f(x):")
    before = chat.history
    saved = {"format": "lucebox-chat", "messages": [{"role": "user", "content": "x"}]}
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "digits.json").write_text(json.dumps(saved)[:-1] + ', "n": 1' + "0" * 10_000 + "}")
    (tmp_path / "surrogate.json").write_text(json.dumps(saved).replace('"x"', '"\\ud800"'))
    (tmp_path / "big.json").write_text(json.dumps(saved) + " " * 100)
    os.mkfifo(tmp_path / "fifo")  # opening it to read would wait for a writer
    for path, message in (("/dev/zero", "not a regular file"), (tmp_path, "not a regular file"),
                          (tmp_path / "fifo", "not a regular file"), (tmp_path / "deep.json", "more than 110 deep"),
                          (tmp_path / "digits.json", "numbers are at most"),
                          (str(tmp_path / "a\0b.json"), "NUL character"),
                          (tmp_path / "surrogate.json", "surrogate"), (tmp_path / "big.json", "larger than 100 bytes")):
        monkeypatch.setattr(lucebox.chat.saved_chat, "CHAT_FILE_MAX_BYTES", 100 if "big" in str(path) else 2**20)
        with pytest.raises(InvalidArgumentError, match=message):
            chat.load(path)
        assert chat.history == before


def test_text_that_is_not_valid_unicode_is_a_typed_error_naming_its_position(builtin):
    with pytest.raises(InvalidArgumentError, match=r"lone surrogate U\+D800 at character 2"):
        builtin.generate("ab\ud800", max_tokens=2)
    chat = builtin.chat(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidArgumentError, match=r"lone surrogate U\+DCFF"):
        chat.send("def f(\udcff):")
    assert chat.history == []
    assert chat.send("def f(x):").token_ids  # the chat goes on


def test_the_model_s_generation_config_gives_the_chat_s_defaults(builtin):
    chat = builtin.chat()
    config = builtin.description.generation_config
    assert config["do_sample"] is True
    assert chat.settings["temperature"] == config["temperature"]
    assert chat.settings["stop"] == ["\n\n\n"]  # the plain template's answers end at two blank lines
    assert builtin.chat(temperature=0.0).settings["temperature"] == 0.0


def test_a_conversation_past_the_context_is_refused_and_answers_are_capped_by_it():
    llm = lucebox.LLM(max_context=64)
    chat = llm.chat(temperature=0.0, max_tokens=500)
    g = chat.send("def f(x):", stop=None)
    assert g.finish_reason == "length" and chat.context_tokens <= 64  # capped by the room left, not refused
    with pytest.raises(ContextLengthError, match="max_context is 64"):
        chat.send("x" * 400)
    assert chat.history[-1]["role"] == "assistant"  # the refused message did not join the history


def test_plain_and_speculative_requests_interleave_on_one_engine(builtin, builtin_drafted):
    """speculate=False skips the drafter for one request; the drafter then catches up (or starts over)
    instead of drafting from rows it never saw, and every output is the target's own."""
    prompt = builtin.tokenizer.encode("import sys\n\n\ndef main(argv):\n")
    expected = builtin.generate(prompt, max_tokens=30, temperature=0.0).token_ids
    longer = prompt + expected[:10]
    expected_longer = builtin.generate(longer, max_tokens=30, temperature=0.0).token_ids
    spec = builtin_drafted.generate(prompt, max_tokens=30, temperature=0.0)
    plain = builtin_drafted.generate(longer, max_tokens=30, temperature=0.0, speculate=False)
    again = builtin_drafted.generate(longer, max_tokens=30, temperature=0.0)
    assert spec.token_ids == expected and plain.token_ids == again.token_ids == expected_longer
    assert set(plain.stats["width_histogram"]) == {0}  # no round verified a draft
    assert max(again.stats["width_histogram"]) > 0


def test_after_a_stop_string_the_context_holds_no_text_the_history_lacks(builtin):
    """The tokens that completed a stop string (and any text after it in the same token) are not
    carried into the next turn: the conversation is tokenized again from its history."""
    chat = builtin.chat(temperature=0.0, max_tokens=60)
    free = chat.send("def scale(v, k):").text
    stop = free[6:9]
    chat.reset()
    g = chat.send("def scale(v, k):", stop=[stop])
    assert g.finish_reason == "stop" and g.text == free[: free.index(stop)]
    assert chat.context.ids is None  # nothing held past the answer's text
    chat.send("def norm(v):", max_tokens=8)
    assert chat.last_prompt_ids == encode_all(  # tokenized whole from the history: no stop-string text
        builtin.tokenizer, render(builtin.tokenizer, chat.history[:-1], add_generation_prompt=True))
