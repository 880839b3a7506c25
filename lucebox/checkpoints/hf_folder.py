"""Reading a Hugging Face model folder: JSON files, weight shards, and filling tensors from them.

Weights are described by *sources* (see `lucebox.models.sources`): where each of our tensors comes
from in the checkpoint. `load_weights` allocates each destination tensor once, in its final dtype
and device, and copies the checkpoint's tensors straight into it (or into slices of it, for fused
and stacked tensors), one tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from lucebox import bounded_json
from lucebox.checkpoints.safetensors_file import SafetensorsFile, read_header
from lucebox.checkpoints.source_check import describe_shape, resolve_sources
from lucebox.errors import (
    ConfigError,
    JSONInputError,
    ModelNotFoundError,
    PickleCheckpointError,
    TensorDtypeError,
    TensorShapeError,
)
from lucebox.model_files import MODEL_JSON_MAX_BYTES, inside_folder
from lucebox.models.layout import stored_dtype
from lucebox.models.sources import Cat, Source, Stack, Unloaded, leaf_names

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def locate_config(path: str | Path) -> Path:
    """The config.json of a model folder, or a config.json path given directly (enough for
    `lucebox info` and load_format='dummy')."""
    given = Path(path).expanduser()
    if not given.exists():
        raise ModelNotFoundError(f"model folder {given} does not exist; pass a local Hugging Face model folder, "
                                 "a .gguf file, or laguna-code-6m for the built-in model")
    if given.is_file():
        if given.suffix != ".json":
            raise ModelNotFoundError(f"{given} is a file; pass the model folder that holds config.json")
        return given
    config = given / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"{given} has no config.json; is this a Hugging Face model folder?")
    return config




def read_json(path: Path, required: bool = True) -> dict | None:
    """A model folder's JSON file (`lucebox.bounded_json`'s bounds), a ConfigError saying what is wrong."""
    if not path.is_file():
        if required:
            raise ModelNotFoundError(f"{path} is missing")
        return None
    try:
        data = bounded_json.loads(bounded_json.read_regular_file(path, "the model file", MODEL_JSON_MAX_BYTES),
                                  str(path), nonfinite=True)  # an infinite float as transformers writes it
    except JSONInputError as e:
        raise ConfigError(f"{e}; re-download it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or model.safetensors, or all *.safetensors,
    each checked to stay inside the folder (`inside_folder`)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map' object")
        if not all(isinstance(s, str) for s in weight_map.values()):
            raise ConfigError(f"{index}: every 'weight_map' value must be a file name")
        shards = [inside_folder(folder, s, index) for s in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelNotFoundError(
                f"{index} lists shard(s) that are not in {folder}: {', '.join(missing[:5])}; "
                "the download is incomplete"
            )
        return shards
    single = folder / "model.safetensors"
    if single.is_file():
        return [inside_folder(folder, single.name, folder)]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return [inside_folder(folder, p.name, folder) for p in found]
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(
            f"{folder} holds only pickle weights ({', '.join(pickles[:3])}); lucebox never unpickles, "
            "since loading a pickle can run arbitrary code. Convert the checkpoint to safetensors "
            "(e.g. save_pretrained(..., safe_serialization=True)) and try again"
        )
    raise ModelNotFoundError(f"{folder} has no weights (*.safetensors); use load_format='dummy' for random weights")


class CheckpointIndex:
    """Which file holds which tensor, with every header validated up front."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.location: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self._open: dict[Path, SafetensorsFile] = {}
        for path in files:
            for name, entry in read_header(path).items():
                self.location[name] = path
                self.shapes[name] = entry.shape
                self.dtypes[name] = entry.dtype

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def copy_into(self, name: str, dest: torch.Tensor, check=None) -> None:
        """Copy checkpoint tensor `name` into `dest` (after `check(file, entry)`, if given), then
        drop its mapped pages. Files open on first use and stay open until `close`."""
        path = self.location[name]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        f = self._open[path]
        if check is not None:
            check(path, f.entries[name])
        view = f.view(name)
        dest.copy_(view)
        del view
        f.release(name)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open = {}

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fill(dest: torch.Tensor, source: Source, read: Callable[[str, torch.Tensor], None], name: str) -> None:
    """Write `source` into `dest`, part by part (Cat along dim 0, Stack along a new dim 0)."""
    if isinstance(source, str):
        read(source, dest)
    elif isinstance(source, Stack):
        if len(source.parts) != dest.shape[0]:
            raise TensorShapeError(
                f"{name}: expected {dest.shape[0]} stacked parts, checkpoint has {len(source.parts)}"
            )
        for i, part in enumerate(source.parts):
            _fill(dest[i], part, read, name)
    elif isinstance(source, Cat):
        offset = 0
        for part, rows in zip(source.parts, source.sizes, strict=True):
            _fill(dest.narrow(0, offset, rows), part, read, name)
            offset += rows
    else:  # pragma: no cover - resolve_sources removes alternatives
        raise TypeError(f"unresolved source for {name}: {source!r}")


def load_weights(
    index: CheckpointIndex,
    sources: dict[str, Source],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device | Callable[[str], torch.device],
    unloaded: tuple[Unloaded, ...] = (),
    transform: Callable[[str, torch.Tensor], object] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of `sources`, read into `dtype` on `device`; `transform(name, tensor)`, if
    given, replaces each as soon as it is read (quantization), so only one full-precision tensor
    is held at a time. `progress(done, total)` is told the bytes read so far after each tensor."""
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(index, sources, shapes, dtype, device, unloaded, progress):
        weights[name] = transform(name, tensor) if transform is not None else tensor
        del tensor
    return weights


def iter_weights(
    index: CheckpointIndex,
    sources: dict[str, Source],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype | None,
    device: torch.device | Callable[[str], torch.device],
    unloaded: tuple[Unloaded, ...] = (),
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) one at a time, in `dtype` on `device` (or `device(name)`: experts bound for
    host memory are read there); with dtype None, each in the checkpoint's own dtype (that of its
    first part), so a caller that streams them on (`lucebox quantize`) holds one tensor at a time.
    Every name is checked before the first is read."""
    chosen = resolve_sources(sources, shapes, index, unloaded)
    def read_dtype(name: str, source: Source) -> torch.dtype:
        # Routers are held wider than the model dtype: read them so, not rounded through it first.
        return stored_dtype(name, dtype) if dtype is not None else index.dtypes[next(leaf_names(source))]

    total = sum(math.prod(shapes[name]) * read_dtype(name, src).itemsize for name, src in chosen.items())
    done = 0
    with index:

        def read(ckpt_name: str, dest: torch.Tensor) -> None:
            def check(path: Path, entry) -> None:
                if not entry.dtype.is_floating_point:
                    # lucebox reads float checkpoints only (it quantizes them itself), so integer codes
                    # here would be converted to floats as if they were weights
                    raise TensorDtypeError(
                        f"{path.name}: tensor {ckpt_name} is {entry.dtype}, but it is a float weight; "
                        "this is not a float checkpoint: load a float one (with quantization=), or one "
                        "written by `lucebox quantize`"
                    )
                if tuple(entry.shape) != tuple(dest.shape):
                    raise TensorShapeError(
                        f"{path.name}: tensor {ckpt_name} has shape {describe_shape(entry.shape)}, "
                        f"config.json implies {describe_shape(tuple(dest.shape))}"
                    )

            index.copy_into(ckpt_name, dest, check)

        for name, source in chosen.items():
            dest = torch.empty(shapes[name], dtype=read_dtype(name, source),
                               device=device(name) if callable(device) else device)
            _fill(dest, source, read, name)
            done += dest.numel() * dest.element_size()
            yield name, dest
            del dest
            if progress is not None:
                progress(done, total)
