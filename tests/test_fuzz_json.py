"""JSON from strangers, fuzzed: a saved chat (`/load`) and a model's JSON files with one value replaced
by nesting past any recursion limit, a number past what Python converts or float64 holds, or a
constant JSON has not. Each must load or raise a LuceboxError (tests/fuzzing.py's rule), and a chat
that refuses a file keeps its conversation. The reader itself: tests/test_bounded_json.py;
config.json's mutations also run in test_fuzz.py's folder fuzz."""

import json
import random
import time

import pytest
from fuzzing import hostile_json, run_cases, splice_hostile

import lucebox
from lucebox.builtin import BUILTIN_MODEL
from lucebox.chat.saved_chat import chat_record

SEED, MAX_CASES, BUDGET_S = 29, 200, 10.0

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a word",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}]


def _saved_chat() -> dict:
    settings = {"temperature": 0.0, "max_tokens": 4, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "repetition_penalty": 1.0, "seed": 7, "stop": ["\n\n"],
                "json_schema": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10}}},
                "grammar": None, "json_object": False}
    messages = [{"role": "user", "content": "def f(x):"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": {"word": "x"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "lookup", "content": "a letter"},
                {"role": "assistant", "content": "    return x"}]
    tools = {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True, "tool_parser": "hermes"}
    return json.loads(chat_record("laguna-code-6m", "# helpers", settings, messages, tools))


@pytest.fixture(scope="module")
def chat():
    return lucebox.LLM(draft=None).chat(tools=TOOLS, tool_parser="hermes", temperature=0.0, max_tokens=4)


def test_saved_chats_with_hostile_values_load_or_raise_typed_errors_and_keep_the_conversation(chat, tmp_path):
    path = tmp_path / "chat.json"
    record = _saved_chat()
    path.write_text(json.dumps(record))
    chat.load(path)  # the unmutated file loads
    before = chat.history
    rng = random.Random(SEED)

    def cases():
        while True:
            mutated = splice_hostile(rng, record, hostile_json(rng)).encode()
            path.write_bytes(mutated)
            yield "chat.json", mutated

    def exercise():
        try:
            chat.load(path)
        except lucebox.LuceboxError:
            assert chat.history == before  # a refused file changes nothing
            raise

    start = time.perf_counter()
    tried, outcomes, failures = run_cases(cases(), exercise, MAX_CASES, BUDGET_S)
    print(f"fuzz: {tried} saved chats in {time.perf_counter() - start:.1f} s (seed {SEED}); outcomes {outcomes}")
    # nearly every hostile value is past a bound (the file is read within 110 levels, a schema or call within
    # 100: a value 101 deep where nothing reads it loads)
    assert tried >= 30 and outcomes.get("ok", 0) <= tried // 20
    assert not failures, "\n".join(failures[:10])


def test_model_json_files_with_hostile_values_raise_typed_errors(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    base = BUILTIN_MODEL
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.model",
                 "model.safetensors"):  # copies: a link out of a model folder is refused
        (folder / name).write_bytes((base / name).read_bytes())
    rng = random.Random(SEED)
    originals = {name: json.loads((folder / name).read_text()) for name in ("config.json", "generation_config.json",
                                                                          "tokenizer_config.json")
                 if (folder / name).is_file()}

    def cases():
        while True:
            name = rng.choice(sorted(originals))
            mutated = splice_hostile(rng, originals[name], hostile_json(rng)).encode()
            (folder / name).write_bytes(mutated)
            yield name, mutated
            (folder / name).write_text(json.dumps(originals[name]))

    tried, outcomes, failures = run_cases(cases(), lambda: lucebox.LLM(folder, draft=None, max_context=64),
                                          60, BUDGET_S)
    print(f"fuzz: {tried} model JSON files (seed {SEED}); outcomes {outcomes}")
    assert tried >= 20  # NaN and Infinity load as transformers writes them; what they break is a typed error
    assert not failures, "\n".join(failures[:10])
