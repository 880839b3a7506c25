"""Seeded random mutations of a tiny model folder (safetensors header, config.json, tokenizer files):
each must load and run correctly or raise a LuceboxError, within the time and memory of
tests/fuzzing.py's rule; a crash fails the test. Bounded in count and in time; prints how many it
tried. test_fuzz_gguf.py holds GGUF files to the same rule."""

import json
import random
import shutil
import struct
import time
from collections.abc import Iterator

import pytest
from fuzzing import hostile_json, run_cases, splice_hostile
from tokenizers import Tokenizer, models, pre_tokenizers

import lucebox
import lucebox.text.chat_template

SEED, MAX_CASES, BUDGET_S = 13, 600, 20.0
INTERESTING = [0, -1, 1, 2, 3, 7, 64, 2**31, 2**63, 10**7, 0.5, -0.0, 1e308, float("nan"), float("inf"), True,
               False, None, "", "x", "../x", [], [1], [-1, 2**40], {}, {"a": 1}]
CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
               "rope_parameters", "rope_scaling", "sliding_window", "tie_word_embeddings", "attention_bias",
               "mlp_bias", "hidden_act", "bos_token_id", "eos_token_id", "architectures", "torch_dtype"]
ROPE = [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
        "high_freq_factor": 1.0}, {"rope_type": "linear"}, {"rope_theta": -1.0}, {"partial_rotary_factor": 0.3}]
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F4", 7]
TEMPLATES = ["{{ messages }}", "{% for m in messages %}{{ m.content * 99999999 }}{% endfor %}", "{{ x.__class__ }}",
             "{{ raise_exception('no') }}", "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
             "{% endfor %}", "{{ ''.__class__.__mro__ }}", "{%", "{{ 1/0 }}", "{{ messages[9] }}", 7, None, ["x"]]


def _header(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def mutate_weights(rng: random.Random, raw: bytes) -> bytes:
    header, data = _header(raw)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    kind = rng.randrange(7)
    if kind == 0:
        header[name]["dtype"] = rng.choice(DTYPES)
    elif kind == 1:
        shape = header[name]["shape"]
        if shape:
            shape[rng.randrange(len(shape))] = rng.choice(INTERESTING)
        else:
            header[name]["shape"] = rng.choice(INTERESTING)
    elif kind == 2:
        offsets = header[name]["data_offsets"]
        offsets[rng.randrange(2)] += rng.choice([-4, -1, 1, 4, 2**40, -2**40])
    elif kind == 3:
        header[name]["data_offsets"] = list(header[rng.choice(names)]["data_offsets"])
    elif kind == 4:
        header[name] = rng.choice(INTERESTING)
    elif kind == 5:
        cut = rng.randrange(len(raw))
        return raw[:cut]
    else:
        out = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(min(len(out), 8 + 400))] = rng.randrange(256)
        return bytes(out)
    return _with_header(header, data)


def mutate_json(rng: random.Random, raw: bytes, keys: list[str]) -> bytes:
    data = json.loads(raw)
    kind = rng.randrange(6)
    if kind == 5:  # nesting past any recursion limit, numbers past what Python converts, NaN
        return splice_hostile(rng, data, hostile_json(rng)).encode()
    if kind == 0 and data:
        del data[rng.choice(sorted(data))]
    elif kind == 1:
        data[rng.choice(keys)] = rng.choice(INTERESTING + ROPE)
    elif kind == 2:
        data[rng.choice(sorted(data) or keys)] = rng.choice(INTERESTING)
    elif kind == 3:
        out = bytearray(raw)
        out[rng.randrange(len(out))] = rng.randrange(32, 127)
        return bytes(out)
    else:
        return json.dumps(data).encode()[: rng.randrange(len(raw))]
    return json.dumps(data).encode()


def mutate_tokenizer(rng: random.Random, raw: bytes) -> bytes:
    data = json.loads(raw)
    vocab = data["model"]["vocab"]
    kind = rng.randrange(4)
    if kind == 0:
        vocab[rng.choice(sorted(vocab))] = rng.choice(INTERESTING)
    elif kind == 1:
        vocab[f"w{rng.randrange(10**6)}"] = rng.choice([128, 129, 10**6, 2**32 - 1])
    elif kind == 2:
        data["added_tokens"] = [{"id": rng.choice(INTERESTING), "content": "<x>", "special": True}]
    else:
        return mutate_json(rng, raw, ["model", "normalizer", "pre_tokenizer", "decoder", "post_processor"])
    return json.dumps(data).encode()


def mutate_tokenizer_config(rng: random.Random, raw: bytes) -> bytes:
    data = json.loads(raw)
    key = rng.choice(["chat_template", "bos_token", "eos_token", "added_tokens_decoder", "add_bos_token"])
    if key == "chat_template":
        data[key] = rng.choice(TEMPLATES)
    elif key == "added_tokens_decoder":
        data[key] = {str(rng.choice([0, 127, 128, 10**9])): {"content": rng.choice(INTERESTING), "special": True}}
    else:
        data[key] = rng.choice(INTERESTING + [{"content": 5}, {"content": "w3"}])
    return json.dumps(data).encode()


@pytest.fixture(scope="module")
def base_folder(reference_models, tmp_path_factory):
    folder, _ = reference_models("llama")
    base = tmp_path_factory.mktemp("fuzz-base")
    shutil.copytree(folder, base, dirs_exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "w1", "eos_token": "w2",
        "chat_template": "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"}))
    return base


def exercise(folder) -> None:
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=64)
    llm.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
    prompt = llm.tokenizer.apply_chat_template([{"role": "w3", "content": "w4 w5"}])
    llm.generate(prompt, max_tokens=2, stop=["w9"])


def folder_cases(rng: random.Random, folder, originals: dict[str, bytes], mutators: dict) -> Iterator:
    """Endless cases: one file of `folder` mutated (and put back before the next)."""
    while True:
        name = rng.choice(sorted(mutators))
        try:
            mutated = mutators[name](rng, originals[name])
        except (KeyError, TypeError, IndexError, ValueError, AttributeError):
            continue  # this mutation does not apply to this file
        (folder / name).write_bytes(mutated)
        yield name, mutated
        (folder / name).write_bytes(originals[name])


def test_mutated_model_folders_load_or_raise_typed_errors(base_folder, tmp_path, monkeypatch):
    # the limit itself is tested in test_hardening.py
    monkeypatch.setattr(lucebox.text.chat_template, "TEMPLATE_SECONDS", 1.0)
    mutators = {
        "model.safetensors": mutate_weights,
        "config.json": lambda rng, raw: mutate_json(rng, raw, CONFIG_KEYS),
        "tokenizer.json": mutate_tokenizer,
        "tokenizer_config.json": mutate_tokenizer_config,
    }
    folder = tmp_path / "m"
    shutil.copytree(base_folder, folder)
    originals = {name: (base_folder / name).read_bytes() for name in mutators}
    exercise(folder)  # the unmutated folder works
    start = time.perf_counter()
    cases = folder_cases(random.Random(SEED), folder, originals, mutators)
    tried, outcomes, failures = run_cases(cases, lambda: exercise(folder), MAX_CASES, BUDGET_S)
    print(f"fuzz: {tried} mutations in {time.perf_counter() - start:.1f} s (seed {SEED}); outcomes {outcomes}")
    assert tried >= 50
    assert not failures, "\n".join(failures[:10])


def test_the_fuzz_rule_fails_untyped_errors_and_memory_past_the_limit(monkeypatch):
    import fuzzing

    monkeypatch.setattr(fuzzing, "MEMORY_LIMIT", 2**20)
    actions = iter([lambda: None, lambda: [str(i) for i in range(100_000)], lambda: {}["x"],
                    lambda: lucebox.LLM(None, device="cpu", max_context=-1)])
    tried, outcomes, failures = run_cases(((str(i), b"") for i in range(4)), lambda: next(actions)(), 10, 60.0)
    assert tried == 4 and outcomes == {"ok": 2, "untyped": 1, "InvalidArgumentError": 1}
    assert len(failures) == 2
    assert failures[0].startswith("Python objects peaked at") and failures[1].startswith("KeyError")
