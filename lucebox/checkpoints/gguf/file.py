"""Reading a llama.cpp GGUF file (through the `gguf` package's reader): its metadata as plain Python
values, and its tensors as model-dtype tensors (float types) or `QuantizedTensor`s (block types).

GGUF lists a tensor's dimensions innermost first (`ne[0]` is the row length); here every shape is
the usual torch order, outermost first, so a linear weight is (out_features, in_features) as in
safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lucebox.checkpoints.gguf.blocks import BLOCK_SHAPES, unpack
from lucebox.errors import CorruptCheckpointError, ModelNotFoundError, TensorDtypeError
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


def _plain(value: object) -> object:
    """A metadata value as str, int, float, bool or a list of those (numpy scalars unwrapped)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def gguf_metadata(reader) -> dict[str, object]:
    """Every metadata key of a `gguf.GGUFReader` mapped to a plain Python value (str, int, float,
    bool, or a list of those; string arrays as list[str]). The reader's `GGUF.*` entries are the
    file header (version, counts), not metadata, and are left out."""
    return {name: _plain(field.contents()) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]  # torch order: outermost first
    type_name: str  # "F32", "Q4_K", ...
    data: np.ndarray  # memory-mapped: floats in `shape`, or block bytes (..., bytes per row)


class GGUFFile:
    """The metadata and tensor index of one GGUF file; tensors stay memory-mapped until read."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        try:
            reader = gguf.GGUFReader(path)
        except (ValueError, OSError, IndexError) as e:
            raise CorruptCheckpointError(f"{path} is not a readable GGUF file: {e}") from None
        self.metadata = gguf_metadata(reader)
        self.tensors: dict[str, TensorEntry] = {
            t.name: TensorEntry(tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name, t.data)
            for t in reader.tensors
        }

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
        if entry.type_name in FLOAT_TYPES:
            return self._float(entry).to(device=device, dtype=dtype)
        raw = torch.from_numpy(np.array(entry.data)).to(device)  # a copy: the map is read-only
        return unpack(raw, entry.type_name, entry.shape, dtype)

    @staticmethod
    def _float(entry: TensorEntry) -> torch.Tensor:
        if entry.type_name == "BF16":  # the reader hands bfloat16 over as raw bytes
            raw = np.array(entry.data).view(np.int16)
            return torch.from_numpy(raw).view(torch.bfloat16).reshape(entry.shape)
        return torch.from_numpy(np.array(entry.data)).reshape(entry.shape)
