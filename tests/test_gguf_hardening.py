"""A GGUF file is untrusted input, held to the safetensors path's checks: counts and lengths within
the file and a metadata budget before any Python object is built, unique keys and tensor names,
tensors aligned, inside the data section and apart, sizes from type and shape, every divisor in
range before it divides, RoPE factors > 0, one token per embedding row. The audit's reproducers
are here, each made by editing a tiny valid file byte by byte (tests/gguf_bytes.py)."""

from __future__ import annotations

import copy
import math
import struct
import tracemalloc

import pytest
from gguf_bytes import (
    ARRAY,
    FLOAT32,
    STRING,
    UINT32,
    Field,
    TensorRecord,
    read_layout,
    tiny_spm_tokenizer,
    write_layout,
)
from gguf_models import VOCAB, write_tiny_gguf

import lucebox
from lucebox.checkpoints.gguf.config import hf_config_from_gguf
from lucebox.checkpoints.loading import describe_model
from lucebox.errors import ConfigError, CorruptCheckpointError, TensorShapeError, TokenizerError


@pytest.fixture(scope="module")
def base_layout(tmp_path_factory):
    """A tiny qwen3 (Q8_0) with a SentencePiece tokenizer of one token per embedding row."""
    path = tmp_path_factory.mktemp("gguf-base") / "model.gguf"
    write_tiny_gguf("qwen3", "Q8_0", path)
    layout = read_layout(path)
    layout.fields += tiny_spm_tokenizer(VOCAB)
    return layout


@pytest.fixture
def edited(base_layout, tmp_path):
    """change(layout) -> the path of the base file with that change written in."""
    def edit(change=None):
        layout = copy.deepcopy(base_layout)
        if change is not None:
            change(layout)
        return write_layout(layout, tmp_path / "model.gguf")

    return edit


def peak_bytes_of(action) -> int:
    """The most bytes Python objects held at once while `action()` ran."""
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_base_file_loads_and_speaks(edited):
    llm = lucebox.LLM(edited(), device="cpu", dtype="float32", max_context=64)
    ids = llm.tokenizer.encode("w3 w4")
    assert llm.tokenizer.decode(ids) == "w3 w4"
    assert len(llm.generate(ids, max_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_few_megabytes_of_token_strings_cost_no_more_than_they_hold(edited):
    """200,000 empty token strings (2 MB) cost the gguf package's reader ~300 MB of Python objects
    and loaded; now they cost their list and are refused, as the embedding has 128 rows."""
    path = edited(lambda layout: setattr(layout.get("tokenizer.ggml.tokens"), "value", [""] * 200_000))

    def describe():
        with pytest.raises(TokenizerError, match="200000 tokens but token_embd.weight has 128 rows"):
            describe_model(path)

    assert peak_bytes_of(describe) < 16 * 2**20


def _declare(key: str, count: int):
    return lambda layout: setattr(layout.get(key), "declared", count)


@pytest.mark.parametrize("change, message", [
    (lambda layout: layout.counts.update(tensors=2**40), "claims 1099511627776 tensors"),
    (lambda layout: layout.counts.update(keys=2**62), "claims 4611686018427387904 keys"),
    (_declare("tokenizer.ggml.tokens", 2**40), "'tokenizer.ggml.tokens' claims 1099511627776 entries"),
    (_declare("tokenizer.ggml.scores", 10**6), "'tokenizer.ggml.scores' claims 1000000 entries"),
    (_declare("tokenizer.chat_template", 2**63), "claims 9223372036854775808 bytes"),
], ids=["tensor-count", "key-count", "array-count", "array-count-just-past-the-end", "string-length"])
def test_counts_beyond_what_the_file_holds_are_refused_before_reading(edited, change, message):
    path = edited(change)

    def describe():
        with pytest.raises(CorruptCheckpointError, match=message):
            describe_model(path)

    assert peak_bytes_of(describe) < 2**20


def test_metadata_beyond_the_element_budget_is_refused(edited, monkeypatch):
    """Three arrays of 128 in the base file; with a budget of 300 elements the third is refused."""
    monkeypatch.setattr("lucebox.checkpoints.gguf.container.MAX_ELEMENTS", 300)
    with pytest.raises(CorruptCheckpointError, match="claims 128 entries; lucebox's limit is 44"):
        describe_model(edited())


def test_a_duplicate_metadata_key_is_refused(edited):
    path = edited(lambda layout: layout.fields.append(Field("qwen3.block_count", UINT32, 2)))
    with pytest.raises(CorruptCheckpointError, match="metadata key 'qwen3.block_count' appears twice"):
        describe_model(path)


def _tensor(index: int, **changes):
    def change(layout):
        for name, value in changes.items():
            setattr(layout.tensors[index], name, value(layout) if callable(value) else value)
    return change


@pytest.mark.parametrize("change, message", [
    (_tensor(1, offset=lambda layout: layout.tensors[1].offset + 1), "not a multiple of the alignment 32"),
    (_tensor(2, offset=lambda layout: layout.tensors[1].offset), "'blk.0.attn_q.weight' and .* overlap"),
    (_tensor(2, offset=lambda layout: layout.tensors[1].offset + 64), "overlap"),
    (_tensor(-1, offset=lambda layout: len(layout.data)), "passes the end of the file"),
    (_tensor(1, dims=[256, 100_000]), r"Q8_0 \[100000, 256\], 27200000 bytes\) at offset 34816 passes the end"),
    (_tensor(1, dims=[48, 256]), "rows of 48 elements, not whole blocks of 32"),
    (_tensor(1, dims=[256, 256, 1, 1, 1]), "has 5 dimensions"),
    (_tensor(1, dims=[256, 0]), r"'blk.0.attn_q.weight' has a dimension of 0 \(dimensions \[256, 0\]\)"),
    (_tensor(1, type_id=99), "type number 99, which is no ggml type"),
    (_tensor(2, name="blk.0.attn_q.weight"), "tensor 'blk.0.attn_q.weight' appears twice"),
], ids=["misaligned", "shared", "overlapping", "past-the-end", "shape-past-the-end", "partial-block", "five-dims",
        "zero-dim", "unknown-type", "duplicate-name"])
def test_tensor_offsets_are_aligned_inside_the_file_and_apart(edited, change, message):
    with pytest.raises(CorruptCheckpointError, match=message):
        describe_model(edited(change))


def _rope_freqs(dims: list[int], type_id: int = 0, nbytes: int | None = None):
    """A rope_freqs.weight (GGUF order `dims`, F32 unless told) of factors 1.0, after the data."""
    def change(layout):
        offset = -(-len(layout.data) // layout.alignment) * layout.alignment
        count = math.prod(dims)
        data = struct.pack(f"<{count}f", *[1.0] * count) if nbytes is None else bytes(nbytes)
        layout.data += bytes(offset - len(layout.data)) + data
        layout.tensors.append(TensorRecord("rope_freqs.weight", dims, type_id, offset))
    return change


def test_an_empty_axis_is_refused_before_the_others_are_read(edited):
    """rope_freqs with dimensions [0, N] was 0 bytes of shape (N, 0), and its read built N empty
    lists: 1.5 GB for N = 2**24, a MemoryError for 2**63 - 1."""
    path = edited(_rope_freqs([0, 2**63 - 1]))

    def describe():
        with pytest.raises(CorruptCheckpointError, match="'rope_freqs.weight' has a dimension of 0"):
            describe_model(path)

    assert peak_bytes_of(describe) < 2**20


def test_rope_freqs_is_read_only_in_the_shape_and_type_the_rotary_dimension_needs(edited):
    """Head size 64: 32 factors. One more, a column of 32 (whose rows were each read as a list) or
    a quantized tensor is refused from the index, before the tensor is read."""
    cfg = describe_model(edited(_rope_freqs([32]))).cfg
    assert all(layer.rope.freq_factors == (1.0,) * 32 for layer in cfg.layers)
    for change, what in ((_rope_freqs([33]), r"F32 \[33\]"), (_rope_freqs([1, 32]), r"F32 \[32, 1\]"),
                         (_rope_freqs([32], type_id=8, nbytes=34), r"Q8_0 \[32\]")):
        with pytest.raises(TensorShapeError, match=f"rope_freqs.weight is {what}; lucebox needs a float tensor "
                                                   r"\(F32, F16, BF16\) of shape \[32\]"):
            describe_model(edited(change))


def _set(key: str, value, kind: int = UINT32):
    def change(layout):
        layout.fields = [f for f in layout.fields if f.key != key] + [Field(key, kind, value)]
    return change


def _without_key_length(key: str, value: int):
    """No key_length, so head_dim is embedding_length // head_count; `key` set to `value`."""
    def change(layout):
        layout.fields = [f for f in layout.fields if not f.key.endswith(("key_length", "value_length"))]
        _set(key, value)(layout)
    return change


@pytest.mark.parametrize("change, message", [
    (_without_key_length("qwen3.attention.head_count", 0),
     r"num_attention_heads must be in 1\.\.4096, got 0 \(from GGUF key 'qwen3.attention.head_count'\)"),
    (_set("qwen3.attention.head_count_kv", 0), "from GGUF key 'qwen3.attention.head_count_kv'"),
    (_set("qwen3.attention.key_length", 0), "from GGUF key 'qwen3.attention.key_length'"),
    (_without_key_length("qwen3.embedding_length", 2),  # 2 // 4 heads
     "model.gguf: its metadata, read as config.json, is refused: head_dim must be in"),
    (_set("qwen3.rope.freq_base", -1.0, FLOAT32), "rope_theta must be > 0"),
], ids=["head-count", "kv-head-count", "key-length", "derived-head-dim", "rope-base"])
def test_every_divisor_is_in_range_before_it_divides(edited, change, message):
    """head_count 0 used to raise ZeroDivisionError; the one range check config.json goes through
    now runs on the translated metadata first."""
    with pytest.raises(ConfigError, match=message):
        describe_model(edited(change))


def test_a_zero_rope_scaling_factor_is_refused_not_read_as_one(edited):
    def yarn_factor_zero(layout):
        _set("qwen3.rope.scaling.type", "yarn", STRING)(layout)
        _set("qwen3.rope.scaling.factor", 0.0, FLOAT32)(layout)

    with pytest.raises(ConfigError, match="rope factor must be > 0, got 0.0"):
        describe_model(edited(yarn_factor_zero))


@pytest.mark.parametrize("tokens", [VOCAB + 1, VOCAB - 1], ids=["more-tokens-than-rows", "fewer"])
def test_one_token_per_embedding_row(edited, tokens):
    """More tokens than rows used to load and fail at generation (IndexError, a device assert on
    CUDA); fewer made generated ids decode to '' unseen. llama.cpp refuses both, so does lucebox."""
    def tokenizer_of(layout):
        layout.fields = [f for f in layout.fields if not f.key.startswith("tokenizer.")] + tiny_spm_tokenizer(tokens)

    with pytest.raises(TokenizerError, match=f"holds {tokens} tokens but token_embd.weight has {VOCAB} rows"):
        lucebox.LLM(edited(tokenizer_of), device="cpu", dtype="float32")


def test_nested_arrays_and_unknown_value_types_are_refused(edited):
    path = edited(lambda layout: layout.fields.append(Field("x.nested", ARRAY, [], ARRAY)))
    with pytest.raises(CorruptCheckpointError, match="'x.nested' is an array of type 9"):
        describe_model(path)
    path = edited(lambda layout: layout.fields.append(Field("x.odd", 13, b"")))
    with pytest.raises(CorruptCheckpointError, match="'x.odd' has value type 13"):
        describe_model(path)


def test_a_misshaped_half_of_a_fused_weight_is_named_before_reading(edited):
    """A float ffn_up one column wide used to reach torch.cat with ffn_gate's 256: a RuntimeError."""
    def one_row_up(layout):
        up = layout.tensor("blk.0.ffn_up.weight")
        up.dims, up.type_id = [1, 256], 0  # F32, rows of one element

    with pytest.raises(TensorShapeError, match=r"blk.0.ffn_up.weight has shape \[256, 1\], the metadata implies "
                                               r"\[256, 256\] \(for layers.0.w_gate_up\)"):
        lucebox.LLM(edited(one_row_up), device="cpu", dtype="float32")


def test_a_zero_sliding_window_period_is_refused(tmp_path):
    """laguna.attention.sliding_window_pattern 0 used to raise ZeroDivisionError (il % 0)."""
    metadata = {"general.architecture": "laguna", "laguna.block_count": 2, "laguna.embedding_length": 256,
                "laguna.attention.head_count": [4, 4], "laguna.attention.key_length": 64,
                "laguna.attention.layer_norm_rms_epsilon": 1e-5, "laguna.attention.sliding_window": 8,
                "laguna.attention.sliding_window_pattern": 0}
    with pytest.raises(ConfigError, match="'laguna.attention.sliding_window_pattern' is 0"):
        hf_config_from_gguf(metadata, lambda name: name == "token_embd.weight", lambda name: (VOCAB, 256),
                            tmp_path / "model.gguf")
