"""`lucebox quantize` and saved quantized checkpoints: what is loaded is bit for bit what was
quantized, the checkpoint is streamed one tensor at a time, and a folder whose metadata is missing
or disagrees with its weights is refused."""

from __future__ import annotations

import json
import shutil
import weakref

import pytest
import torch
from lucebox.kernels.quant import QuantizedTensor, quantize
from lucebox.models.layout import quantizable

import lucebox
from lucebox.checkpoints.quantized import METADATA_FILE
from lucebox.cli import main
from lucebox.cli import quantize as quantize_command
from lucebox.cli.quantize import quantize_checkpoint
from lucebox.errors import CheckpointError, InvalidArgumentError

SMALL_SHARDS = 20_000  # bytes: the tiny models then span several shards


def _engine(folder, **options):
    return lucebox.LLM(folder, device="cpu", dtype="float32", **options)


def _assert_same_weights(saved: dict, expected: dict) -> None:
    assert saved.keys() == expected.keys()
    for name, want in expected.items():
        got = saved[name]
        assert type(got) is type(want), name
        if isinstance(want, QuantizedTensor):
            assert (got.bits, got.group, got.shape, got.dtype) == (want.bits, want.group, want.shape, want.dtype), name
            assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales), name
            assert (got.zeros is None) == (want.zeros is None), name
        else:
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize(("arch", "bits", "group"), [("qwen3_moe", 4, None), ("laguna", 8, None), ("qwen3_moe", 4, 32)])
def test_a_saved_checkpoint_loads_exactly_what_was_quantized(reference_models, tmp_path, arch, bits, group):
    folder, _ = reference_models(arch)
    out = tmp_path / "quantized"
    summary = quantize_checkpoint(folder, out, bits, group, shard_bytes=SMALL_SHARDS)
    assert summary["shards"] > 1 and (out / "config.json").is_file()
    saved = _engine(out)
    assert saved.setup.quantization == f"int{bits}"
    plain = _engine(folder).engine.decoder.w
    expected = {name: quantize(w, f"int{bits}", group) if quantizable(name) else w for name, w in plain.items()}
    _assert_same_weights(saved.engine.decoder.w, expected)
    if group is None:  # the same codes as quantizing on load, so the same tokens
        on_load = _engine(folder, quantization=f"int{bits}")
        prompt = [3, 17, 5, 9]
        assert saved.generate(prompt, max_tokens=6, ignore_eos=True).token_ids == \
            on_load.generate(prompt, max_tokens=6, ignore_eos=True).token_ids


def test_quantizing_holds_one_float_weight_at_a_time(reference_models, tmp_path, monkeypatch):
    folder, _ = reference_models("qwen3_moe")
    read = quantize_command.iter_weights
    alive: list[weakref.ref] = []

    def watched(*args, **kwargs):
        for name, tensor in read(*args, **kwargs):
            assert all(ref() is None for ref in alive), f"a float weight read before {name} is still held"
            if quantizable(name):  # the others are stored as they are, in the shard being filled
                alive.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    monkeypatch.setattr(quantize_command, "iter_weights", watched)
    quantize_checkpoint(folder, tmp_path / "q", 4, shard_bytes=SMALL_SHARDS)
    assert len(alive) > 10


@pytest.fixture(scope="module")
def saved_int4(reference_models, tmp_path_factory):
    folder, _ = reference_models("qwen3_moe")
    out = tmp_path_factory.mktemp("saved") / "int4"
    quantize_checkpoint(folder, out, 4, shard_bytes=SMALL_SHARDS)
    return out


def _damaged(saved, tmp_path, change):
    copy = tmp_path / "damaged"
    shutil.copytree(saved, copy)
    metadata = json.loads((copy / METADATA_FILE).read_text())
    change(copy, metadata)
    if (copy / METADATA_FILE).exists():
        (copy / METADATA_FILE).write_text(json.dumps(metadata))
    return copy


def _drop(copy, metadata):
    (copy / METADATA_FILE).unlink()


def _bits(copy, metadata):
    metadata["tensors"]["layers.1.experts_down"]["bits"] = 8


def _group(copy, metadata):
    metadata["tensors"]["layers.0.wq"]["group"] = 32


def _forget(copy, metadata):
    del metadata["tensors"]["layers.1.router"]


def _format(copy, metadata):
    metadata["version"] = 7


def _shape(copy, metadata):
    metadata["tensors"]["embed"]["shape"] = [1, 1]


@pytest.mark.parametrize(("change", "message"), [
    (_drop, r"holds quantized weights \(.*\.codes\) but no lucebox_quantization\.json"),
    (_bits, r"layers\.1\.experts_down\.codes is uint8 \[8, 64, 16\], the metadata implies int8 \[8, 64, 32\]"),
    (_group, r"layers\.0\.wq\.scales is float16 \[64, 1\], the metadata implies float16 \[64, 2\]"),
    (_forget, r"it lists \d+ tensors, config\.json implies \d+ \(missing \['layers\.1\.router'\]"),
    (_format, r"is not a lucebox-quantized version 1 file"),
    (_shape, r"embed is recorded as .*config\.json implies shape"),
])
def test_missing_or_inconsistent_metadata_is_refused(saved_int4, tmp_path, change, message):
    with pytest.raises(CheckpointError, match=message):
        _engine(_damaged(saved_int4, tmp_path, change))


def test_a_saved_checkpoint_keeps_its_scheme(saved_int4):
    with pytest.raises(InvalidArgumentError, match="saved int4 checkpoint; it cannot be loaded as quantization='int8'"):
        _engine(saved_int4, quantization="int8")
    with pytest.raises(InvalidArgumentError, match="already a quantized checkpoint"):
        quantize_checkpoint(saved_int4, saved_int4.parent / "again", 8)


def test_quantize_command(reference_models, tmp_path, capsys):
    folder, _ = reference_models("qwen3_moe")
    assert main(["quantize", str(folder), str(tmp_path / "q8"), "--bits", "8"]) == 0
    assert "tensors as int8" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "q8"), "--vram", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vram_plan"]["choices"]["quantization"] == "int8"
    for args, message in [(["--bits", "3"], "--bits 3 is not supported"),
                          (["--bits", "4", "--group", "64"], "--group 64 does not divide the 96 inputs of"),
                          (["--bits", "4"], "already exists; choose a new folder or pass --overwrite")]:
        out = tmp_path / ("q8" if "already" in message else "other")
        assert main(["quantize", str(folder), str(out), *args]) == 2
        assert message in capsys.readouterr().err


def test_the_builtin_model_quantizes_with_its_drafter_and_tokenizer(tmp_path):
    from lucebox.builtin import builtin_model

    out = tmp_path / "code-int4"
    quantize_checkpoint(builtin_model(), out, 4)
    assert (out / "dflash" / "config.json").is_file() and (out / "tokenizer.model").is_file()
    llm = lucebox.LLM(out, device="cpu", draft="auto")
    plain = lucebox.LLM(out, device="cpu")
    prompt = "def mean(xs):\n"
    assert llm.generate(prompt, max_tokens=12, temperature=0.0).text == plain.generate(prompt, max_tokens=12,
                                                                                      temperature=0.0).text
