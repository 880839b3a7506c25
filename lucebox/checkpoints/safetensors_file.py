"""A checked, memory-mapped reader of one `.safetensors` file.

We parse the header ourselves so a corrupt file gives a typed error that names the file and the
problem, and we hand out zero-copy views of the mapping one tensor at a time. After a tensor has
been copied to its destination, `release` drops its pages from this process (MADV_DONTNEED), so
loading never holds the weights twice: once in their final tensors, once as mapped file pages.
"""

from __future__ import annotations

import json
import math
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


def quoted(text: object) -> str:
    """A name read from a header, shortened, for messages (never more than 60 characters of it)."""
    text = str(text)
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice")
    return dict(pairs)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate the header as the safetensors library does: every entry names a known
    dtype, a shape of non-negative integers and in-bounds offsets whose length fits the shape, and
    the entries tile the data area exactly (contiguous, no overlap, no trailing bytes).

    Messages never quote the file's bytes: a file that is not safetensors at all (a text file, a
    pickle) must not have its first bytes printed as a "header length"."""
    size = os.path.getsize(path)
    header, base = _json_header(path, size)
    entries = {name: _entry(path, name, info, base, size) for name, info in header.items()}
    _check_tiling(path, entries, base, size)
    return entries


def _json_header(path: Path, size: int) -> tuple[dict, int]:
    """The header's tensor entries (__metadata__ checked and removed) and the data area's file offset."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _corrupt(path, "file shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > _HEADER_LIMIT or 8 + header_len > size:
            raise _corrupt(path, f"its first 8 bytes are not a header length that fits a file of {size} bytes")
        text = f.read(header_len)
    if not text.startswith(b"{"):
        raise _corrupt(path, "the header is not a JSON object")
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise _corrupt(path, "the header is not UTF-8 text") from None
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        why = f"line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise _corrupt(path, f"the header is not valid JSON ({why})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise _corrupt(path, "__metadata__ is not a map of strings")
    return header, 8 + header_len


def _entry(path: Path, name: str, info: object, base: int, size: int) -> TensorEntry:
    """The header's entry `info` for tensor `name`, checked; the data area starts at byte `base`."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(path, f"tensor {quoted(name)} is not an entry of dtype, shape and data_offsets")
    kind, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(kind, str):
        raise _corrupt(path, f"tensor {quoted(name)} has a dtype that is not a string")
    if kind not in DTYPES:
        raise CorruptCheckpointError(
            f"{path}: tensor {quoted(name)} has dtype {quoted(kind)}, which lucebox cannot read "
            f"(supported: {', '.join(DTYPES)}); convert the checkpoint to bf16/fp16/fp32"
        )
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _corrupt(path, f"tensor {quoted(name)} has a shape that is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)
            and offsets[0] <= offsets[1]):
        raise _corrupt(path, f"tensor {quoted(name)} has data_offsets that are not two ordered non-negative "
                             "integers")
    dtype, (start, end) = DTYPES[kind], offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - start != expected:
        raise _corrupt(path, f"tensor {quoted(name)} ({kind}{shape}) needs {expected} bytes but its offsets "
                             f"[{start}, {end}) hold {end - start}")
    if base + end > size:
        raise _corrupt(path, f"the offsets [{start}, {end}) of tensor {quoted(name)} pass the end of the file")
    return TensorEntry(name, dtype, tuple(shape), base + start, base + end)


def _check_tiling(path: Path, entries: dict[str, TensorEntry], base: int, size: int) -> None:
    # The entries, in offset order, must tile the data area: each starts where the previous ended.
    position = base
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != position:
            how = "overlaps the tensor before it" if e.start < position else "leaves a gap before it"
            raise _corrupt(path, f"tensor {quoted(e.name)} {how} (offsets must be contiguous)")
        position = e.end
    if position != size:
        raise _corrupt(path, f"{size - position} bytes after the last tensor belong to none")


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
