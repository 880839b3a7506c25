"""Reading a llama.cpp GGUF file (parsed and checked by `container`): its metadata as plain Python
values, and its tensors as model-dtype tensors (float types) or `QuantizedTensor`s (block types).

GGUF lists a tensor's dimensions innermost first (`ne[0]` is the row length); here every shape is
the usual torch order, outermost first, so a linear weight is (out_features, in_features) as in
safetensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lucebox.checkpoints.gguf.blocks import BLOCK_SHAPES, unpack
from lucebox.checkpoints.gguf.container import TensorInfo, read_container
from lucebox.errors import ModelNotFoundError, TensorDtypeError
from lucebox.kernels.quant import QuantizedTensor

FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(BLOCK_SHAPES)


def locate_gguf(path: str | Path) -> Path | None:
    """The .gguf file `path` names, or the one .gguf in the folder `path`; None when `path` is
    neither (a Hugging Face folder). A folder with several .gguf files is ambiguous: refused."""
    given = Path(path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return given
    if not given.is_dir() or (given / "config.json").is_file():
        return None
    found = sorted(given.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ModelNotFoundError(f"{given} holds {len(found)} .gguf files ({names}); pass the one to load")
    return found[0] if found else None


class GGUFFile:
    """The metadata and tensor index of one GGUF file, checked (`container.read_container`);
    tensors stay memory-mapped until read."""

    def __init__(self, path: Path):
        self.path = path
        container = read_container(path)
        self.metadata = container.metadata
        self.tensors: dict[str, TensorInfo] = container.tensors
        self._data = container.data

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | QuantizedTensor:
        """Tensor `name`: float types converted to `dtype`, block types repacked, never widened."""
        entry = self.tensors[name]
        if entry.type_name not in SUPPORTED_TYPES:
            raise TensorDtypeError(f"{self.path.name}: tensor {name} is {entry.type_name}, which lucebox cannot read "
                                   f"(supported: {', '.join(SUPPORTED_TYPES)})")
        raw = np.frombuffer(self._data, np.uint8, entry.nbytes, entry.start)
        if entry.type_name in FLOAT_TYPES:
            return _floats(raw, entry).to(device=device, dtype=dtype)
        return unpack(torch.from_numpy(raw.copy()).to(device), entry.type_name, entry.shape, dtype)


_FLOAT_LAYOUTS = {"F32": (np.float32, None), "F16": (np.float16, None), "BF16": (np.int16, torch.bfloat16)}


def _floats(raw: np.ndarray, entry: TensorInfo) -> torch.Tensor:
    """A float tensor from its little-endian bytes (a copy: the map is read-only); numpy has no
    bfloat16, so those come over as int16 and are reinterpreted."""
    stored, reinterpreted = _FLOAT_LAYOUTS[entry.type_name]
    tensor = torch.from_numpy(raw.view(np.dtype(stored).newbyteorder("<")).astype(stored)).reshape(entry.shape)
    return tensor if reinterpreted is None else tensor.view(reinterpreted)
