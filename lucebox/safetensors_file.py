"""A checked, memory-mapped reader of one `.safetensors` file.

We parse the header ourselves so a corrupt file gives a typed error that names the file and the
problem, and we hand out zero-copy views of the mapping one tensor at a time. After a tensor has
been copied to its destination, `release` drops its pages from this process (MADV_DONTNEED), so
loading never holds the weights twice: once in their final tensors, once as mapped file pages.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.errors import CorruptCheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_HEADER_LIMIT = 100 * 1024 * 1024  # the format's own cap on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def _corrupt(path: Path, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: not a valid safetensors file ({why}); re-download or re-export this file"
    )


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate the header; every tensor's byte range must fit its shape and the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _corrupt(path, "file shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > _HEADER_LIMIT or 8 + header_len > size:
            raise _corrupt(path, f"header length {header_len} does not fit a file of {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _corrupt(path, f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    base = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] not in DTYPES:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}, which lucebox cannot read "
                f"(supported: {', '.join(DTYPES)}); convert the checkpoint to bf16/fp16/fp32"
            )
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _corrupt(path, f"tensor {name!r} has a malformed entry ({e!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * dtype.itemsize
        if start < 0 or end - start != expected or base + end > size:
            raise _corrupt(
                path,
                f"tensor {name!r} ({info['dtype']}{list(shape)}) needs {expected} bytes but its "
                f"offsets [{start}, {end}) {'pass the end of the file' if base + end > size else 'disagree'}",
            )
        entries[name] = TensorEntry(name, dtype, shape, base + start, base + end)
    return entries


class SafetensorsFile:
    """One mapped file. Use as a context manager; views must not outlive it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = read_header(self.path)
        self._file = open(self.path, "rb")
        size = os.path.getsize(self.path)
        # ACCESS_COPY gives a writable (private, never written) mapping, which torch.frombuffer wants.
        self._map = mmap.mmap(self._file.fileno(), size, access=mmap.ACCESS_COPY) if size else None

    def view(self, name: str) -> torch.Tensor:
        """A zero-copy CPU tensor over the mapped bytes of `name`."""
        e = self.entries[name]
        numel = (e.end - e.start) // e.dtype.itemsize
        if numel == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(self._map, dtype=e.dtype, count=numel, offset=e.start)
        return flat.view(e.shape)

    def release(self, name: str) -> None:
        """Drop the pages of `name` from this process's memory; the file keeps them on disk."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        e = self.entries[name]
        page = mmap.PAGESIZE
        start = (e.start // page) * page
        if e.end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, e.end - start)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
