"""Saved quantized checkpoints: `lucebox quantize` writes them, `LLM(folder)` loads them as stored.

Such a folder holds the source model's config.json and tokenizer files, safetensors shards keyed by
our own tensor names (see `lucebox.models.layout`): a quantized weight `layers.3.wq` is stored as
`layers.3.wq.codes`, `layers.3.wq.scales` (and `layers.3.wq.zeros` when asymmetric), exactly the
fields of `QuantizedTensor`; every other tensor is stored under its name in the checkpoint's dtype.
`lucebox_quantization.json` records the scheme and, for every tensor, its logical shape and group,
so a load checks each stored tensor against it and against config.json before reading any of it,
and a folder whose metadata is missing, partial or disagrees with the weights is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from lucebox.checkpoints.hf_folder import CheckpointIndex, read_json, weight_files
from lucebox.config import ModelConfig
from lucebox.errors import CheckpointError
from lucebox.kernels.quant import SCHEMES, QuantizedTensor
from lucebox.models.layout import quantizable, weight_shapes

METADATA_FILE = "lucebox_quantization.json"
FORMAT = "lucebox-quantized"
VERSION = 1


def stored_fields(name: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
    """The safetensors entries of one quantized weight."""
    fields = {f"{name}.codes": q.codes, f"{name}.scales": q.scales}
    if q.zeros is not None:
        fields[f"{name}.zeros"] = q.zeros
    return fields


def tensor_record(q: torch.Tensor | QuantizedTensor) -> dict:
    """What the metadata file says about one tensor."""
    if isinstance(q, QuantizedTensor):
        return {"shape": list(q.shape), "bits": q.bits, "group": q.group, "zeros": q.zeros is not None}
    return {"shape": list(q.shape), "dtype": str(q.dtype).removeprefix("torch.")}


def saved_scheme(folder: Path) -> str | None:
    """The scheme ("int8", "int4") of a saved quantized checkpoint, or None for a float one. A
    folder whose weights are quantized but whose metadata file is missing is refused here."""
    metadata = folder / METADATA_FILE
    if metadata.is_file():
        return _read_metadata(folder)["scheme"]
    if any(p.name.endswith(".safetensors") for p in folder.iterdir()):
        codes = next((n for n in CheckpointIndex(weight_files(folder)).location if n.endswith(".codes")), None)
        if codes is not None:
            raise CheckpointError(
                f"{folder} holds quantized weights ({codes}) but no {METADATA_FILE}, which records how they "
                "were quantized; the folder is incomplete: run `lucebox quantize` again")
    return None


def _read_metadata(folder: Path) -> dict:
    path = folder / METADATA_FILE
    data = read_json(path)
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} file "
                              f"(format {data.get('format')!r}, version {data.get('version')!r})")
    if data.get("scheme") not in SCHEMES or not isinstance(data.get("tensors"), dict):
        raise CheckpointError(f"{path}: 'scheme' must be one of {', '.join(SCHEMES)} and 'tensors' an object; "
                              "run `lucebox quantize` again")
    return data


def _refuse(folder: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{folder / METADATA_FILE} disagrees with the weights: {why}; "
                           "the folder is damaged or mixed: run `lucebox quantize` again")


def _expected_entries(name: str, record: dict, shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple]]:
    """The stored entries (name -> dtype, shape) a metadata record implies."""
    if "bits" not in record:
        return {name: (None, shape)}
    bits, group, K = record["bits"], record["group"], shape[-1]
    if bits not in (4, 8) or not isinstance(group, int) or group < 1 or K % group or (bits == 4 and group % 2):
        raise CheckpointError(f"{name}: bits {bits} and group {group} do not describe a weight with {K} inputs")
    entries = {f"{name}.codes": (torch.int8 if bits == 8 else torch.uint8, shape[:-1] + (K * bits // 8,)),
               f"{name}.scales": (torch.float16, shape[:-1] + (K // group,))}
    if record.get("zeros"):
        entries[f"{name}.zeros"] = (torch.float16, shape[:-1] + (K // group,))
    return entries


def load_quantized(folder: Path, cfg: ModelConfig, dtype: torch.dtype, place: Callable,
                   progress=None) -> dict[str, torch.Tensor | QuantizedTensor]:
    """Every weight of a saved quantized checkpoint, as stored (plain tensors cast to `dtype`),
    after checking the metadata against config.json and every stored tensor against it; each is
    read into host memory and handed to `place(name, weight)`, which returns it where it belongs."""
    data = _read_metadata(folder)
    records, shapes = data["tensors"], weight_shapes(cfg)
    if set(records) != set(shapes):
        missing, extra = sorted(set(shapes) - set(records)), sorted(set(records) - set(shapes))
        raise _refuse(folder, f"it lists {len(records)} tensors, config.json implies {len(shapes)} "
                              f"(missing {missing[:3]}, not in the model {extra[:3]})")
    index = CheckpointIndex(weight_files(folder))
    expected: dict[str, tuple[torch.dtype, tuple]] = {}
    for name, shape in shapes.items():
        record = records[name]
        if not isinstance(record, dict) or tuple(record.get("shape", ())) != shape:
            raise _refuse(folder, f"{name} is recorded as {record!r}, config.json implies shape {list(shape)}")
        if "bits" in record and not quantizable(name):
            raise _refuse(folder, f"{name} is recorded as quantized, but lucebox never quantizes it")
        expected.update(_expected_entries(name, record, shape))
    for entry, (want_dtype, want_shape) in expected.items():
        if entry not in index:
            raise _refuse(folder, f"{entry} is not in the weight files")
        got_dtype, got_shape = index.dtypes[entry], tuple(index.shapes[entry])
        if got_shape != want_shape or (want_dtype is not None and got_dtype != want_dtype) or \
                (want_dtype is None and not got_dtype.is_floating_point):
            raise _refuse(folder, f"{entry} is {str(got_dtype).removeprefix('torch.')} {list(got_shape)}, the "
                                  f"metadata implies {str(want_dtype or 'a float').removeprefix('torch.')} "
                                  f"{list(want_shape)}")
    extra = sorted(set(index.location) - set(expected))
    if extra:
        raise _refuse(folder, f"the weight files hold {len(extra)} tensor(s) it does not list: {', '.join(extra[:3])}")
    total = sum(math.prod(index.shapes[n]) * index.dtypes[n].itemsize for n in expected)
    done, weights = 0, {}
    with index:

        def read(entry: str) -> torch.Tensor:
            nonlocal done
            tensor = torch.empty(index.shapes[entry], dtype=index.dtypes[entry])  # out of the mapping, in host memory
            index.copy_into(entry, tensor)
            done += tensor.numel() * tensor.element_size()
            return tensor

        for name, shape in shapes.items():  # one weight at a time: read, then placed by `place`
            record = records[name]
            if "bits" not in record:
                weight = read(name).to(dtype)
            else:
                zeros = read(f"{name}.zeros") if record.get("zeros") else None
                weight = QuantizedTensor(read(f"{name}.codes"), read(f"{name}.scales"), zeros, record["bits"],
                                         record["group"], shape, dtype)
            weights[name] = place(name, weight)
            if progress is not None:
                progress(done, total)
    return weights
