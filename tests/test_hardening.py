"""A model folder is untrusted input: files it names stay inside it, headers are validated fully,
sizes and templates cannot make lucebox work without bound, and wrong values become typed errors.
The audit's reproducers are here as regression tests (traversal, leak, overlapping offsets,
layer-count blow-up, template DoS, out-of-vocabulary tokenizer ids, NaN logits, drafter memory)."""

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch
from conftest import EXAMPLES
from drafters import save_dflash
from tokenizers import Tokenizer, models

import lucebox
import lucebox.cli
import lucebox.engine.build
import lucebox.memory.plan
import lucebox.text.chat_template
from lucebox.checkpoints.loading import describe_model
from lucebox.checkpoints.safetensors_file import read_header
from lucebox.errors import (
    CheckpointError,
    ConfigError,
    ContextLengthError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    InvalidArgumentError,
    ModelNotFoundError,
    NonFiniteLogitsError,
    TensorDtypeError,
    TokenizerError,
)


@pytest.fixture
def sharded_copy(model_copy):
    return model_copy("qwen3_moe")


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def rewrite_header(path, change):
    """Apply `change` to the parsed header of a safetensors file, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


# -- 1. stay inside the model folder ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_index_shard_names_cannot_leave_the_folder(sharded_copy, name):
    index = sharded_copy / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["model.embed_tokens.weight"]
    shutil.copy(sharded_copy / shard, sharded_copy.parent / "outside.safetensors")
    edit_json(index, lambda d: d["weight_map"].update({"model.embed_tokens.weight": name}))
    with pytest.raises(CheckpointError, match="outside the model folder"):
        lucebox.LLM(sharded_copy, device="cpu")


def test_links_that_leave_the_folder_are_refused(llama_copy, tmp_path):
    secret = tmp_path / "secret.safetensors"
    shutil.move(llama_copy / "model.safetensors", secret)
    os.symlink(secret, llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside the model folder"):
        lucebox.LLM(llama_copy, device="cpu")


def test_a_linked_folder_and_a_hugging_face_cache_snapshot_load(llama_copy, tmp_path):
    """The rule: a named file must resolve inside the (resolved) folder, or, for a folder that is a
    cache snapshot `<repo>/snapshots/<rev>`, inside `<repo>/blobs/`, where the cache links point."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for f in llama_copy.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    reference = lucebox.LLM(llama_copy, device="cpu").generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids
    cached = lucebox.LLM(snapshot, device="cpu").generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids
    assert cached == reference
    os.symlink(llama_copy, tmp_path / "linked")
    assert lucebox.LLM(tmp_path / "linked", device="cpu").generate(
        [1, 2, 3], max_tokens=4, ignore_eos=True).token_ids == reference


def test_tokenizer_files_linked_out_of_the_folder_are_refused(llama_copy, tmp_path):
    outside = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(outside))
    os.symlink(outside, llama_copy / "tokenizer.json")
    with pytest.raises(CheckpointError, match="outside the model folder"):
        lucebox.LLM(llama_copy, device="cpu")


def test_a_file_that_is_not_safetensors_is_never_quoted(llama_copy):
    """/etc/passwd as a weight file: its first 8 bytes used to be printed as a 'header length'."""
    passwd = b"s3cr3t:x:0:0:s3cr3t:/s3cr3t:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n" * 4
    (llama_copy / "model.safetensors").write_bytes(passwd)
    with pytest.raises(CorruptCheckpointError) as caught:
        lucebox.LLM(llama_copy, device="cpu")
    message = str(caught.value)
    assert "s3cr3t" not in message and str(struct.unpack("<Q", passwd[:8])[0]) not in message
    # a short header length followed by text that is not JSON: no byte of it comes back either
    (llama_copy / "model.safetensors").write_bytes(struct.pack("<Q", 40) + b"\xffs3cr3t:x:0:0" + passwd)
    with pytest.raises(CorruptCheckpointError) as caught:
        lucebox.LLM(llama_copy, device="cpu")
    assert "s3cr3t" not in str(caught.value) and "0xff" not in str(caught.value)


# -- 2. the safetensors header is validated fully ----------------------------------------------------

NORM_A, NORM_B = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"


def _overlap(h):  # B reads A's bytes: both entries are well-formed on their own
    h[NORM_B]["data_offsets"] = list(h[NORM_A]["data_offsets"])


def _gap(h):  # the first tensor's entry is gone: its bytes belong to no tensor
    del h[next(name for name, e in h.items() if name != "__metadata__" and e["data_offsets"][0] == 0)]


@pytest.mark.parametrize("change, message", [
    (_overlap, "overlaps"),
    (_gap, "gap"),
    (lambda h: h[NORM_A].update(shape=[64.0]), "shape"),
    (lambda h: h[NORM_A].update(shape=[True] * 1), "shape"),
    (lambda h: h[NORM_A].update(shape=[-64]), "shape"),
    (lambda h: h[NORM_A].update(shape="64"), "shape"),
    (lambda h: h[NORM_A].update(data_offsets=[1.5, 2]), "data_offsets"),
    (lambda h: h[NORM_A].update(data_offsets=[5, 1]), "data_offsets"),
    (lambda h: h[NORM_A].update(extra=1), "entry"),
    (lambda h: h.update(__metadata__={"format": 1}), "__metadata__"),
])
def test_header_entries_must_be_well_formed_and_tile_the_data(llama_copy, change, message):
    rewrite_header(llama_copy / "model.safetensors", change)
    with pytest.raises(CorruptCheckpointError, match=message):
        lucebox.LLM(llama_copy, device="cpu")


def test_trailing_bytes_and_duplicate_names_are_refused(llama_copy):
    path = llama_copy / "model.safetensors"
    original = path.read_bytes()
    path.write_bytes(original + b"\0" * 8)
    with pytest.raises(CorruptCheckpointError, match="belong to none"):
        read_header(path)
    (n,) = struct.unpack("<Q", original[:8])
    text = original[8 : 8 + n].decode()
    duplicated = text.replace("{", '{"' + NORM_A + '": ' + json.dumps(json.loads(text)[NORM_A]) + ", ", 1)
    path.write_bytes(struct.pack("<Q", len(duplicated)) + duplicated.encode() + original[8 + n :])
    with pytest.raises(CorruptCheckpointError, match="twice"):
        read_header(path)


def test_an_integer_tensor_where_a_float_weight_belongs_is_refused(llama_copy):
    rewrite_header(llama_copy / "model.safetensors", lambda h: h[NORM_A].update(dtype="I32"))
    with pytest.raises(TensorDtypeError, match=r"input_layernorm\.weight is torch\.int32"):
        lucebox.LLM(llama_copy, device="cpu")


# -- 3. bounded work from configs and templates ------------------------------------------------------


def test_a_huge_layer_count_is_refused_before_anything_is_built(llama_copy):
    """num_hidden_layers 10**7 used to build layers for minutes and die at 23 GB."""
    edit_json(llama_copy / "config.json", lambda c: c.update(num_hidden_layers=10**6))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"num_hidden_layers must be in 1\.\.1024"):
        describe_model(llama_copy)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", 64.5, "hidden_size has the wrong type"),
    ("num_attention_heads", True, "num_attention_heads has the wrong type"),
    ("vocab_size", 2**40, "vocab_size must be in"),
    ("intermediate_size", -96, "intermediate_size must be in"),
    ("max_position_embeddings", 2**40, "max_position_embeddings must be in"),
    ("num_key_value_heads", "2", "num_key_value_heads has the wrong type"),
])
def test_every_size_is_checked_for_type_and_range(llama_copy, key, value, message):
    edit_json(llama_copy / "config.json", lambda c: c.update({key: value}))
    with pytest.raises(ConfigError, match=message):
        describe_model(llama_copy)


@pytest.fixture
def templated(llama_copy):
    """The tiny llama with a word-level tokenizer whose chat template each test sets."""
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0")).save(
        str(llama_copy / "tokenizer.json"))

    def with_template(template: str):
        (llama_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        return lucebox.LLM(llama_copy, device="cpu").tokenizer

    return with_template


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # runs forever
    "{{ 'a' * 10**10 }}",  # 10 GB in one operation
    "{{ 'a'|center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ '%01000000000d' % 1 }}",
    "{{ (10 ** 4000) ** 4000 }}",
    "{% for i in range(100000) %}{{ 'abcdefghij' * 100000 }}{% endfor %}",  # 10 GB of output
    "{{ messages[0]['content'] + 1 }}",  # a plain Python error inside the template
], ids=["nested-loop", "repeat", "center", "ljust", "format-width", "power", "output-size", "type-error"])
def test_chat_templates_render_within_time_and_size_limits(templated, monkeypatch, template):
    tok = templated(template)
    monkeypatch.setattr(lucebox.text.chat_template, "TEMPLATE_SECONDS", 0.5)
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 3.0


def test_a_bounded_template_still_renders(templated):
    tok = templated("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}|{% endfor %}{{ '-' * 3 }}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi|---"
    time.sleep(0.1)  # no late timeout may fire into this thread after a render finished
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "user: x|---"


# Each grows one value past the limits step by step, or in one step that multiplies its inputs. (A plain
# {% set x = x ~ x %} in a for loop does not grow: jinja scopes a loop's sets to one iteration; a
# namespace or a recursive macro carries the value on.)
_NS = "{% set ns = namespace(x=START) %}{% for i in range(40) %}{% set ns.x = STEP %}{% endfor %}"
GROWING = {
    "tilde": _NS.replace("START", "'a'").replace("STEP", "ns.x ~ ns.x"),
    "plus-text": _NS.replace("START", "'a'").replace("STEP", "ns.x + ns.x"),
    "plus-list": _NS.replace("START", "[1]").replace("STEP", "ns.x + ns.x"),
    "macro": "{% macro d(x, n) %}{% if n %}{{ d(x ~ x, n - 1) }}{% endif %}{% endmacro %}{{ d('a', 40) }}",
    "block-set": "{% set y = 'a' * 1000000 %}{% set x %}{% for i in range(10000) %}{{ y }}{% endfor %}{% endset %}",
    "shared-list-written": _NS.replace("START", "[1]").replace("STEP", "[ns.x, ns.x]") + "{{ ns.x }}",
    "shared-list-json": _NS.replace("START", "[1]").replace("STEP", "[ns.x, ns.x]") + "{{ ns.x|tojson }}",
    "replace": "{{ ('a' * 1000000).replace('a', 'b' * 1000) }}",
    "join": "{{ ('x' * 1000000)|list|join('y' * 1000) }}",
    "format": "{{ ('{0}' * 100000).format('a' * 10000) }}",
    "batch": "{{ [1]|batch(10000000, 0)|list }}",
    "huge-width": "{{ 'a'.ljust(10 ** 5000) }}",  # named in the error, though Python will not print it
    # == walks shared parts each time they appear, in one built-in step the timer cannot stop
    "compare-repeated": "{% set a = [[[0] * 20] * 100] * 1000 %}{% set b = [[[0] * 20] * 100] * 1000 %}{{ a == b }}",
    "compare-written": "{% set ns = namespace(x=[1], y=[1]) %}{% for i in range(24) %}{% set ns.x = [ns.x, ns.x] %}"
                       "{% set ns.y = [ns.y, ns.y] %}{% endfor %}{{ ns.x == ns.y }}",
    "compare-text": "{% set a = ['x' * 1000000] * 100 %}{% set b = ['x' * 1000000] * 100 %}{{ a == b }}",
    # sum copies the sum so far at every addition
    "sum-lists": "{% set rows = [range(20)|list] * 3000 %}{{ rows|sum(start=[])|length }}",
    "sum-numbers": "{% set x = 2 ** 524000 %}{{ ([x * x] + [1] * 10000)|sum > 0 }}",
    "multiply": "{% set ns = namespace(x=1) %}{% set ns.x = 3 ** 500000 %}{% for i in range(2) %}"
                "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x > 0 }}",
    # what a macro or a call block collects counts as it is written, not only when it is joined
    "macro-written": "{% set s = 'a' * 1000000 %}{% macro m() %}{% for i in range(300) %}{{ s ~ i }}{% endfor %}"
                     "{% endmacro %}{{ m() }}",
    "call-block-written": "{% set s = 'a' * 1000000 %}{% macro box() %}{{ caller() }}{% endmacro %}"
                          "{% call box() %}{% for i in range(300) %}{{ s ~ i }}{% endfor %}{% endcall %}",
}


@pytest.mark.parametrize("template", GROWING.values(), ids=GROWING.keys())
def test_a_template_that_grows_a_value_stops_at_the_size_limit_in_bounded_memory(template):
    templates = lucebox.text.chat_template.ChatTemplates({"default": template}, "chat_template.jinja")
    tracemalloc.start()
    try:
        with pytest.raises(TokenizerError, match=r"chat template from chat_template.jinja: .* \(the limit is \d+ "):
            templates.render("default", [{"role": "user", "content": "hi"}], {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 * 2**20  # a few values at the limit (16 Mi characters), never the gigabytes asked for


def test_the_bounded_sandbox_writes_what_jinja_s_own_sandbox_writes():
    """Its hooks (operators, ~, calls, filters, what {{ }} writes, blocks and macros) change no output."""
    import jinja2.ext
    import jinja2.sandbox

    template = ("{%- set ns = namespace(seen='') -%}{%- macro show(x) -%}[{{ x|trim }}]{%- endmacro -%}"
                "{%- macro box() -%}<{{ caller() }}>{%- endmacro -%}"
                "{%- for m in messages -%}{%- set ns.seen = ns.seen ~ m.role[:1] -%}"
                "{{ '<|' ~ m.role ~ '|>' ~ m.content|replace('\\r\\n', '\\n') }}{{ show(m.content) }}"
                "{{ m.content.split(' ')|join('_') }}{% call box() %}{{ loop.index }}/{{ loop.length }}{% endcall %}"
                "{%- endfor %}{% set block %}{{ ns.seen }}{% endset %}{{ block }} {{ tools|tojson(indent=2) }} "
                "{{ tools|map(attribute='name')|join(', ') }} {{ '%s=%d'|format('n', 3) }} {{ '{}-{}'.format('a', 2) }}"
                " {{ 'x' * 3 }} {{ [1, 2] + [3] }} {{ 2 ** 10 }} {{ 'a' ~ 1 ~ none ~ [1] }} {{ messages[0] }} "
                "{{ 'a\\nb'|indent(2, true) }} {{ dict(a=1)|dictsort }} {{ range(3)|list|sum }} {{ nothing }}"
                "{% for k, v in {'a': (1, 2), 'b': [3]}.items() %}{{ k }}={{ v }};{% endfor %}"
                "{% filter upper %}{{ (1,) }}{% endfilter %}")
    variables = {"messages": [{"role": "system", "content": " be\r\nbrief "}, {"role": "user", "content": "hi there"}],
                 "tools": [{"name": "f", "parameters": {"type": "object"}}]}
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                         extensions=[jinja2.ext.loopcontrols])
    plain.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    ours = lucebox.text.chat_template.ChatTemplates({"default": template}, "t")
    assert ours.render("default", variables["messages"], variables) == plain.from_string(template).render(variables)


@pytest.mark.parametrize("vocab", [{"a": 0, "b": 500}, {"a": 0, "b": 127, "<s>": 128}])
def test_tokenizer_ids_beyond_the_models_vocabulary_are_refused_at_load(llama_copy, vocab):
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(llama_copy / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"token id \d+, but the model's vocabulary is 128"):
        lucebox.LLM(llama_copy, device="cpu")


def test_a_bos_id_beyond_the_vocabulary_is_refused_at_load(llama_copy):
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(llama_copy / "tokenizer.json"))
    edit_json(llama_copy / "config.json", lambda c: c.update(bos_token_id=4000))
    with pytest.raises(TokenizerError, match="token id 4000"):
        lucebox.LLM(llama_copy, device="cpu")


def test_weights_still_load_exactly(llama_copy):
    """The checks refuse nothing a valid checkpoint holds."""
    llm = lucebox.LLM(llama_copy, device="cpu", dtype="float32")
    assert torch.isfinite(llm.logits([1, 2, 3])).all()


# -- 4. the drafter is in the memory plan ------------------------------------------------------------


@pytest.fixture
def drafter_folders(reference_models, tmp_path):
    """The tiny Laguna target, and drafters for it: a DFlash drafter and a draft model (the tiny Llama)."""
    target, _ = reference_models("laguna")
    target_cfg = json.loads((target / "config.json").read_text())
    return target, {"dflash": save_dflash(tmp_path / "dflash", target_cfg, "laguna"),
                    "draft_model": reference_models("llama")[0]}


SMALL = dict(device="cpu", dtype="float32", max_context=512, prefill_chunk=64)


@pytest.mark.parametrize("kind", ["dflash", "draft_model"])
def test_the_memory_plan_predicts_the_drafters_weights_and_rings(drafter_folders, kind):
    """memory() before the first request is the plan; the drafter used to count only its weights
    there (its rings are allocated by the first request)."""
    target, drafters = drafter_folders
    llm = lucebox.LLM(target, draft=drafters[kind], draft_ctx=300, **SMALL)
    planned = llm.memory()["drafter"]
    llm.generate(list(range(1, 100)), max_tokens=8, ignore_eos=True)
    assert llm.memory()["drafter"] == planned


@pytest.mark.parametrize("kind", ["dflash", "draft_model"])
def test_a_draft_ctx_that_does_not_fit_is_refused_before_loading_and_names_what_fits(
        drafter_folders, monkeypatch, kind):
    """draft_ctx=10**8 used to build the engine and fail inside generate with a raw allocator error."""
    target, drafters = drafter_folders
    monkeypatch.setattr(lucebox.memory.plan, "_host_available", lambda: 64 * 2**20)
    real_load = lucebox.engine.build.load_model
    monkeypatch.setattr(lucebox.engine.build, "load_model",
                        lambda *a, **k: pytest.fail("weights loaded before the plan"))
    with pytest.raises(InsufficientMemoryError, match=r"draft_ctx=100000000: .* the largest draft_ctx that fits "
                                                      r"is about (\d+)") as caught:
        lucebox.LLM(target, draft=drafters[kind], draft_ctx=10**8, **SMALL)
    fits = int(re.search(r"about (\d+)", str(caught.value)).group(1))
    assert 1000 < fits < 10**8
    monkeypatch.setattr(lucebox.engine.build, "load_model", real_load)
    llm = lucebox.LLM(target, draft=drafters[kind], draft_ctx=fits, **SMALL)
    assert len(llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True).token_ids) == 4
    assert llm.memory()["drafter"] <= 0.9 * 64 * 2**20


# -- 6. non-finite values are reported --------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"temperature": 0.8, "seed": 1}], ids=["greedy", "sampled"])
def test_nan_logits_raise_a_typed_error_instead_of_token_zero(llama_copy, options):
    """A corrupted weight used to give a stream of token 0 with finish 'length'."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_copy / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, llama_copy / "model.safetensors")
    llm = lucebox.LLM(llama_copy, device="cpu", dtype="float32")
    with pytest.raises(NonFiniteLogitsError, match="NaN or inf"):
        llm.generate([1, 2, 3], max_tokens=4, ignore_eos=True, **options)


@pytest.mark.parametrize("change, message", [
    (lambda c: c["rope_parameters"].update(rope_theta=0.0), "rope_theta must be > 0"),
    (lambda c: c["rope_parameters"].update(rope_theta=-10000.0), "rope_theta must be > 0"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps must be > 0"),
    (lambda c: c["rope_parameters"].update(factor=float("nan")), "rope factor has the wrong type"),
    (lambda c: c["rope_parameters"].update(low_freq_factor=4.0, high_freq_factor=4.0), "high_freq_factor"),
    # a top-level rope_theta beside rope_parameters (which overrides it) used to pass unchecked
    (lambda c: c.update(rope_theta=-1.0), "rope_theta must be > 0"),
    (lambda c: c.update(rope_theta=float("inf")), "rope_theta has the wrong type"),
    (lambda c: c["rope_parameters"].update(factor=0.0), "rope factor must be > 0, got 0.0"),  # was read as 1.0
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 0, "rope_theta": 1e4}),
     "rope factor must be > 0"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                         "original_max_position_embeddings": 0}),
     "original_max_position_embeddings must be in 1"),  # was a ZeroDivisionError
    (lambda c: c.pop("max_position_embeddings") and c.update(rope_parameters={"rope_type": "yarn"}),
     r"rope_type 'yarn' needs 'factor' \(or 'original_max_position_embeddings'\)"),  # blamed 'architectures'
    # partial_rotary_factor times the head size ran before its check: a list or a string repeated
    (lambda c: c.update(partial_rotary_factor=[0.5] * 100_000), "partial_rotary_factor has the wrong type"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor="0.5"), "partial_rotary_factor has the wrong type"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=0), "partial_rotary_factor must be > 0"),
    (lambda c: c.update(partial_rotary_factor=1.5), r"partial_rotary_factor must be in \(0, 1\], got 1.5"),
], ids=["theta-zero", "theta-negative", "eps-negative", "factor-nan", "llama3-order", "top-level-theta-negative",
        "top-level-theta-inf", "llama3-factor-zero", "yarn-factor-zero", "yarn-original-zero", "yarn-no-factor",
        "rotary-list", "rotary-string", "rotary-zero", "rotary-over-one"])
def test_configs_with_impossible_values_are_refused_at_load(llama_copy, change, message):
    edit_json(llama_copy / "config.json", change)
    with pytest.raises(ConfigError, match=message):
        describe_model(llama_copy)


@pytest.mark.parametrize("architectures", [{"LlamaForCausalLM": 1}, [{"a": 1}], [["LlamaForCausalLM"]], 5, []])
def test_architectures_must_be_a_list_naming_the_model_class(llama_copy, tmp_path, architectures):
    """A dict, a nested list or a number used to raise TypeError or KeyError, as a model or as a drafter."""
    drafter = tmp_path / "drafter"
    shutil.copytree(llama_copy, drafter)
    edit_json(drafter / "config.json", lambda c: c.update(architectures=architectures))
    with pytest.raises(ConfigError, match="no 'architectures' list naming the model class"):
        describe_model(drafter)
    with pytest.raises(ConfigError, match="no 'architectures' list naming the model class"):
        lucebox.LLM(llama_copy, device="cpu", draft=str(drafter))


# -- 7. types at the boundary --------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"max_context": 1024.5}, "max_context must be an integer, got 1024.5"),
    ({"prefill_chunk": 64.7}, "prefill_chunk must be an integer, got 64.7"),  # was truncated to 64
    ({"kv_pool_tokens": True}, "kv_pool_tokens must be an integer, got True"),
    ({"kv_reselect_every": 0}, "kv_reselect_every must be >= 1"),
    ({"draft_ctx": 4096.0}, "draft_ctx must be an integer"),
    ({"draft_k": True}, "draft_k must be an integer"),
    ({"adaptive": "no"}, "adaptive must be True or False"),
    ({"cuda_graphs": 1}, "cuda_graphs must be True or False or None"),
    ({"load_progress": 5}, "load_progress must be a function"),
    ({"verify": ["block"]}, r"verify \['block'\] is not one of"),
    ({"device": None}, "device must be"),
    ({"draft": 7}, "draft must be a path"),
])
def test_engine_arguments_are_checked_for_type_and_range(llama_copy, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        lucebox.LLM(llama_copy, **{"device": "cpu", **options})


@pytest.mark.parametrize("prompt, options, message", [
    ([1, 2], {"max_tokens": True}, "max_tokens must be an integer, got True"),  # was one token
    ([1, 2], {"max_tokens": 4.0}, "max_tokens must be an integer"),
    ([1, 2], {"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ([1, 2], {"temperature": 0.8, "top_k": 2.5}, "top_k must be an integer, got 2.5"),
    ([1, 2], {"temperature": 0.8, "top_k": True}, "top_k must be an integer, got True"),
    ([1, 2], {"temperature": 0.8, "top_p": "0.9"}, "top_p must be a finite number"),
    ([1, 2], {"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ([1, 2], {"repetition_penalty": 1e-300}, r"repetition_penalty must be in \[0.001, 1000.0\]"),  # was NaN logits
    ([1, 2], {"temperature": 1e-300}, "temperature must be 0 .greedy. or at least 1e-05"),
    ([1, 2], {"temperature": 0.8, "seed": -1}, r"seed must be in 0\.\.9223372036854775807, got -1"),
    ([1, 2], {"temperature": 0.8, "seed": 2**63}, r"seed must be in 0\.\.9223372036854775807"),
    ([1, 2], {"temperature": 0.8, "seed": 1.5}, "seed must be an integer"),
    ([1, 2], {"stop": b"\n"}, "stop strings must be str, not bytes"),  # was stop token id 10
    ([1, 2], {"stop": ["a", b"\n"]}, "stop strings must be str, not bytes"),
    ([1, 2], {"stop": [True]}, "stop token id must be an integer, got True"),
    ([1, 2], {"stop": 2.0}, "stop token id must be an integer, got 2.0"),
    ([1, 2], {"stop": [1000]}, r"stop token id must be in 0\.\.127, got 1000"),
    ([1, 2], {"ignore_eos": "yes"}, "ignore_eos must be True or False"),
    ([1, 2], {"speculate": 0}, "speculate must be True or False"),
    (b"\x01\x02", {}, "prompt .* must be a sequence of token ids"),  # was token ids 1, 2
    ([1.9, 2], {}, "token id must be an integer, got 1.9"),  # was token 1
    ([True, 2], {}, "token id must be an integer, got True"),
])
def test_request_arguments_are_checked_for_type_and_range(llama_copy, prompt, options, message):
    llm = lucebox.LLM(llama_copy, device="cpu")
    with pytest.raises(InvalidArgumentError, match=message):
        llm.generate(prompt, **{"max_tokens": 4, **options})
    with pytest.raises(InvalidArgumentError, match="token id must be an integer, got 1.7"):
        llm.logits([1.7, 2])
    assert llm.generate([1, 2], max_tokens=4, temperature=0.8, seed=2**63 - 1, stop=[5]).token_ids


def test_cli_errors_name_the_flag_not_the_python_argument(llama_copy, capsys):
    base = ["generate", str(llama_copy), "--token-ids", "1,2", "--device", "cpu", "--max-tokens", "2"]
    for flags, message in ((["--ctx", "4096", "--kv-pool", "16"], "--kv-pool 16 is too small"),
                           (["--seed", "-1", "--temp", "0.5"], "--seed must be in 0..9223372036854775807"),
                           (["--temp", "nan"], "--temp must be a finite number"),
                           (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
                           (["--stop-token-id", "1000"], "--stop-token-id must be in 0..127")):
        assert lucebox.cli.main(base + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("lucebox: error: ") and message in err, err
        assert not re.search(r"(?<![-\w])(kv_pool_tokens|prefill_chunk|temperature|seed|stop token id)", err), err


def test_a_folder_without_weights_says_so_before_any_memory_figure(tmp_path, capsys):
    """A 33B config with no weights used to report that 134 GiB of weights do not fit."""
    shutil.copy(EXAMPLES / "laguna-xs2" / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match=r"has no weights \(\*\.safetensors\)"):
        lucebox.LLM(tmp_path, device="cpu")
    assert lucebox.cli.main(["generate", str(tmp_path), "--token-ids", "1", "--device", "cpu"]) == 2
    assert "has no weights (*.safetensors); use --load-format dummy" in capsys.readouterr().err


def test_weights_that_do_not_fit_raise_insufficient_memory_not_context_length(llama_copy, monkeypatch):
    monkeypatch.setattr(lucebox.memory.plan, "_host_available", lambda: 2**10)
    with pytest.raises(InsufficientMemoryError, match="the weights need") as caught:
        lucebox.LLM(llama_copy, device="cpu")
    assert isinstance(caught.value, MemoryError) and not isinstance(caught.value, ContextLengthError)


def test_piping_the_cli_into_a_reader_that_leaves_ends_quietly(llama_copy):
    """`lucebox generate ... | head -c 5`: the reader here is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    proc = subprocess.run([sys.executable, "-m", "lucebox.cli", "generate", str(llama_copy), "--token-ids", "1,2,3",
                           "--max-tokens", "8", "--device", "cpu", "--ignore-eos"],
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert proc.returncode in (0, 128 + signal.SIGPIPE), proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
