"""Seeded random mutations of a tiny GGUF model with a tokenizer: header (magic, version, counts),
metadata (values, value types, lengths and counts, keys added, removed, repeated or not UTF-8) and
the tensor index (dimensions, types, offsets, names), plus cuts and flipped bytes. Each must load
and run or raise a LuceboxError, within tests/fuzzing.py's time and memory rule."""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterator

import pytest
from fuzzing import run_cases
from gguf_bytes import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, Field, Layout, read_layout, tiny_spm_tokenizer
from gguf_bytes import to_bytes as layout_bytes
from gguf_models import VOCAB, write_tiny_gguf

import lucebox
import lucebox.text.chat_template

SEED, MAX_CASES, BUDGET_S = 7, 60, 8.0
UINT64, INT64, FLOAT64 = 10, 11, 12
NAN, INF = float("nan"), float("inf")
# (type, value) pairs a mutated key may take: zeros, extremes, wrong kinds, long lists
VALUES = [(UINT32, 0), (UINT32, 1), (UINT32, 2**32 - 1), (INT32, -1), (UINT64, 2**63), (INT64, -(2**63)),
          (FLOAT32, 0.0), (FLOAT32, -1.0), (FLOAT32, NAN), (FLOAT32, INF), (FLOAT64, 1e300), (BOOL, True),
          (STRING, ""), (STRING, "yarn"), (STRING, "llama"), (STRING, "gpt2"), (STRING, "{{ x.__class__ }}"),
          (ARRAY, (UINT32, [0])), (ARRAY, (INT32, [-1, 2**31 - 1])), (ARRAY, (STRING, ["x"] * 3)),
          (ARRAY, (STRING, ["w"] * 5000)), (ARRAY, (FLOAT32, [])), (ARRAY, (BOOL, [True, False]))]
KEYS = ["qwen3.rope.scaling.type", "qwen3.rope.scaling.factor", "qwen3.attention.sliding_window", "general.alignment",
        "qwen3.expert_count", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.merges",
        "tokenizer.ggml.eot_token_id", "tokenizer.chat_template.tool_use", "qwen3.attention.head_count"]
COUNTS = [0, 1, 7, 2**20, 2**32, 2**40, 2**63 - 1]


def _typed(kind: int, value) -> Field:
    if kind == ARRAY:
        item, items = value
        return Field("", ARRAY, list(items), item)
    return Field("", kind, value)


def _mutate_metadata(rng: random.Random, layout: Layout) -> None:
    field = rng.choice(layout.fields)
    how = rng.randrange(6)
    if how == 0:  # a new value, of any type
        new = _typed(*rng.choice(VALUES))
        field.kind, field.value, field.item = new.kind, new.value, new.item
    elif how == 1:  # a value type that does not match the bytes that follow
        field.type_written = rng.choice([0, 4, 6, 7, 8, 9, 10, 12, 13, 2**31])
    elif how == 2 and field.kind in (STRING, ARRAY):  # a length or count that lies
        field.declared = max(0, len(field.value) + rng.choice([-1, 1, -5, 100])) if rng.random() < 0.5 \
            else rng.choice(COUNTS)
    elif how == 3:  # a key added (perhaps one already there)
        new = _typed(*rng.choice(VALUES))
        new.key = rng.choice(KEYS + [f.key for f in layout.fields])
        layout.fields.insert(rng.randrange(len(layout.fields) + 1), new)
    elif how == 4:
        layout.fields.remove(field)
    else:  # a key that is empty, not UTF-8, or another key's
        field.key = rng.choice(["", b"\xff\xfe", field.key + "x", rng.choice(layout.fields).key])


def _mutate_tensor(rng: random.Random, layout: Layout) -> None:
    tensor = rng.choice(layout.tensors)
    how = rng.randrange(5)
    if how == 0:
        at = rng.randrange(len(tensor.dims))
        tensor.dims[at] = rng.choice([0, 1, 31, 33, 2**31, 2**63 - 1, tensor.dims[at] * 2])
    elif how == 1:
        tensor.dims = tensor.dims + [1] if rng.random() < 0.5 else tensor.dims[:-1]
    elif how == 2:
        tensor.type_id = rng.choice([0, 1, 2, 3, 8, 12, 14, 30, 39, 99, 2**31])
    elif how == 3:
        tensor.offset = max(0, tensor.offset + rng.choice([-32, -1, 1, 16, 32, 2**40]))
    else:
        other = rng.choice(layout.tensors)
        tensor.offset, tensor.name = (other.offset, tensor.name) if rng.random() < 0.5 else (tensor.offset, other.name)


def mutate_gguf(rng: random.Random, base: Layout) -> bytes:
    layout = copy.deepcopy(base)
    part = rng.choices(range(5), weights=(1, 5, 2, 1, 1))[0]  # the metadata is where most can go wrong
    if part == 0:  # the header
        if rng.random() < 0.5:
            layout.version = rng.choice([0, 1, 2, 4, 2**24])
        else:
            layout.counts[rng.choice(["tensors", "keys"])] = rng.choice(COUNTS)
    elif part == 1:
        _mutate_metadata(rng, layout)
    elif part == 2:
        _mutate_tensor(rng, layout)
    raw = layout_bytes(layout)
    if part == 3:
        return raw[: rng.randrange(len(raw))]
    if part == 4:
        out = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(min(len(out), 4096))] = rng.randrange(256)
        return bytes(out)
    return raw


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory) -> Layout:
    path = tmp_path_factory.mktemp("fuzz-gguf") / "model.gguf"
    write_tiny_gguf("qwen3", "F16", path)  # the torch reference dequantizes block types at every step: slow here
    layout = read_layout(path)
    layout.fields += tiny_spm_tokenizer(VOCAB)
    return layout


def exercise(path) -> None:
    """Load, generate from ids, and use the tokenizer (test_fuzz.py generates from text and stops
    on strings; here the tokenizer is what the metadata builds, so it is encoded and decoded)."""
    llm = lucebox.LLM(path, device="cpu", dtype="float32", max_context=64)
    llm.generate([1, 2, 3], max_tokens=2, ignore_eos=True)
    if llm.tokenizer is not None:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "w3", "content": "w4 w5"}]))
        llm.tokenizer.decode(ids)


def gguf_cases(rng: random.Random, base: Layout, path) -> Iterator[tuple[str, bytes]]:
    while True:
        try:
            mutated = mutate_gguf(rng, base)
        except (TypeError, ValueError, OverflowError, IndexError, KeyError, AttributeError):
            continue  # the writer cannot encode this mutation (a value out of its type's range)
        path.write_bytes(mutated)
        yield "model.gguf", mutated


def test_mutated_gguf_files_load_or_raise_typed_errors(base_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(lucebox.text.chat_template, "TEMPLATE_SECONDS", 1.0)
    path = tmp_path / "model.gguf"
    path.write_bytes(layout_bytes(base_gguf))
    exercise(path)  # the unmutated file works
    start = time.perf_counter()
    cases = gguf_cases(random.Random(SEED), base_gguf, path)
    tried, outcomes, failures = run_cases(cases, lambda: exercise(path), MAX_CASES, BUDGET_S)
    print(f"fuzz: {tried} GGUF mutations in {time.perf_counter() - start:.1f} s (seed {SEED}); outcomes {outcomes}")
    assert tried >= 25
    assert not failures, "\n".join(failures[:10])
