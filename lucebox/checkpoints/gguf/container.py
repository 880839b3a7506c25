"""The GGUF container, parsed and checked by lucebox before anything is built from it.

A GGUF file is a header (magic, version, tensor count, key count), the metadata (typed key/value
pairs), the tensor index (name, dimensions, type, offset) and the data section, which starts at
the first multiple of `general.alignment` (32 by default) after the index. The file is untrusted
input, held to the checks the safetensors reader makes:

- every count and length is checked against the bytes left before anything is read, so a count
  that claims more entries than the rest of the file could hold is refused at once;
- the metadata's array elements (all arrays together) and bytes have a budget, checked before
  any Python object is built: a few megabytes declaring millions of tokens cannot cost gigabytes;
- keys and tensor names are unique;
- each tensor's dimensions are all at least 1, and its byte size is computed from its type and
  shape (Python integers: no overflow); its offset is a multiple of the alignment, it lies inside
  the data section, and no two tensors overlap. So every tensor's element count is bounded by the
  file's size: an empty axis would let the others be anything at no cost in bytes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucebox.checkpoints.safetensors_file import quoted
from lucebox.errors import CheckpointError, CorruptCheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # llama.cpp reads these two; version 1 stored 32-bit counts
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
# Real files hold well under a million array elements (a 256k vocabulary's tokens, scores and
# types, or 150k tokens and their merges) in a few MB; as Python objects an element costs ~60 bytes.
MAX_ELEMENTS = 1 << 22
MAX_METADATA_BYTES = 1 << 28
STRING, ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
BOOL = 7
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: outermost first (GGUF lists the row length first)
    type_name: str  # "F32", "Q4_K", ...
    start: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Little-endian reads from the mapped file, each inside `end` (the file's end, or the end of
    the metadata's byte budget while the metadata is read)."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.pos, self.end = data, path, 0, len(data)

    def error(self, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: not a valid GGUF file ({why}); re-download or re-convert it")

    def take(self, size: int, what: str) -> int:
        """The offset of the next `size` bytes, which must lie before `end`."""
        if size > self.end - self.pos:
            where = "the file ends" if self.end == len(self.data) else "the metadata's byte budget ends"
            raise self.error(f"{what} needs {size} bytes at offset {self.pos}, but {where} at {self.end}")
        self.pos += size
        return self.pos - size

    def scalar(self, fmt: str, what: str) -> int | float:
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def count(self, item_bytes: int, what: str, limit: int, unit: str = "entries") -> int:
        """A u64 count of items of at least `item_bytes` bytes each, refused when it exceeds `limit`
        or what the bytes left could hold."""
        n = self.scalar("<Q", f"the length of {what}")
        room = (self.end - self.pos) // item_bytes
        if n > min(room, limit):
            why = f"lucebox's limit is {limit}" if n > limit else f"the {self.end - self.pos} bytes left hold {room}"
            raise self.error(f"{what} claims {n} {unit}; {why}")
        return n

    def string(self, what: str) -> str:
        return self.strings(1, what)[0]

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings (a u64 length, then UTF-8 bytes), each inside `end`. One tight loop: a
        vocabulary is hundreds of thousands of them."""
        data, pos, end, out = self.data, self.pos, self.end, []
        for _ in range(n):
            size = _U64.unpack_from(data, pos)[0] if end - pos >= 8 else None
            if size is None or size > end - pos - 8:
                self.pos = pos
                self.count(1, what, MAX_METADATA_BYTES, "bytes")  # raises, saying which limit
                self.take(size, what)
            try:
                out.append(str(data[pos + 8 : pos + 8 + size], "utf-8"))
            except UnicodeDecodeError:
                raise self.error(f"{what} is not UTF-8 text") from None
            pos += 8 + size
        self.pos = pos
        return out


class _Metadata:
    """The key/value section, read within the element and byte budgets."""

    def __init__(self, cursor: _Cursor) -> None:
        self.cursor, self.elements_left = cursor, MAX_ELEMENTS

    def read(self, count: int) -> dict[str, object]:
        cur = self.cursor
        cur.end = min(len(cur.data), cur.pos + MAX_METADATA_BYTES)
        values: dict[str, object] = {}
        for _ in range(count):
            key = cur.string("a metadata key")
            if key in values:
                raise cur.error(f"metadata key {quoted(key)} appears twice")
            values[key] = self.value(cur.scalar("<I", f"the type of {quoted(key)}"), key)
        cur.end = len(cur.data)
        return values

    def value(self, kind: int, key: str) -> object:
        cur = self.cursor
        if kind == STRING:
            return cur.string(f"the value of {quoted(key)}")
        if kind in _SCALARS:
            value = cur.scalar(_SCALARS[kind], f"the value of {quoted(key)}")
            return value != 0 if kind == BOOL else value
        if kind != ARRAY:
            raise cur.error(f"metadata key {quoted(key)} has value type {kind}, which GGUF does not define")
        item = cur.scalar("<I", f"the element type of {quoted(key)}")
        if item != STRING and item not in _SCALARS:  # nested arrays included: llama.cpp reads none
            raise cur.error(f"metadata key {quoted(key)} is an array of type {item}, which lucebox does not read")
        item_bytes = 8 if item == STRING else struct.calcsize(_SCALARS[item])
        n = cur.count(item_bytes, f"the array {quoted(key)}", self.elements_left)
        self.elements_left -= n
        if item == STRING:
            return cur.strings(n, f"an element of {quoted(key)}")
        array = np.frombuffer(cur.data, np.dtype(_SCALARS[item]), n, cur.take(n * item_bytes, quoted(key)))
        return (array != 0).tolist() if item == BOOL else array.tolist()


def _type_sizes(cur: _Cursor, type_id: int, name: str) -> tuple[str, int, int]:
    """(name, elements per block, bytes per block) of ggml type number `type_id`."""
    import gguf

    try:
        kind = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise cur.error(f"tensor {quoted(name)} has type number {type_id}, which is no ggml type") from None
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    return kind.name, block, block_bytes


def _tensor_info(cur: _Cursor) -> tuple[TensorInfo, int]:
    """One tensor's index entry, with its offset relative to the data section (placed later)."""
    name = cur.string("a tensor name")
    n_dims = cur.scalar("<I", f"the dimension count of tensor {quoted(name)}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"tensor {quoted(name)} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = struct.unpack_from(f"<{n_dims}Q", cur.data, cur.take(8 * n_dims, f"the shape of {quoted(name)}"))
    type_name, block, block_bytes = _type_sizes(cur, cur.scalar("<I", f"the type of {quoted(name)}"), name)
    offset = cur.scalar("<Q", f"the offset of {quoted(name)}")
    if 0 in dims:  # no weight has an empty axis; one would make every other axis free of the file's size
        raise cur.error(f"tensor {quoted(name)} has a dimension of 0 (dimensions {list(dims)})")
    if dims[0] % block:
        raise cur.error(f"tensor {quoted(name)} ({type_name}) has rows of {dims[0]} elements, not whole blocks "
                        f"of {block}")
    nbytes = math.prod(dims[1:]) * (dims[0] // block) * block_bytes
    return TensorInfo(name, tuple(reversed(dims)), type_name, 0, nbytes), offset


def _alignment(cur: _Cursor, metadata: dict[str, object]) -> int:
    value = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise cur.error(f"general.alignment is {quoted(value)}, not a power of two")
    return value


def _place(cur: _Cursor, entries: list[tuple[TensorInfo, int]], alignment: int) -> dict[str, TensorInfo]:
    """The tensors at their absolute offsets, each checked: aligned, inside the file, no overlap."""
    data_start = -(-cur.pos // alignment) * alignment
    placed: dict[str, TensorInfo] = {}
    for info, offset in entries:
        if info.name in placed:
            raise cur.error(f"tensor {quoted(info.name)} appears twice")
        what = f"tensor {quoted(info.name)} ({info.type_name} {list(info.shape)}, {info.nbytes} bytes)"
        if offset % alignment:
            raise cur.error(f"{what} has offset {offset}, not a multiple of the alignment {alignment}")
        if data_start + offset + info.nbytes > len(cur.data):
            raise cur.error(f"{what} at offset {offset} passes the end of the file")
        placed[info.name] = TensorInfo(info.name, info.shape, info.type_name, data_start + offset, info.nbytes)
    previous = None
    for info in sorted((t for t in placed.values() if t.nbytes), key=lambda t: t.start):
        if previous is not None and info.start < previous.start + previous.nbytes:
            raise cur.error(f"tensors {quoted(previous.name)} and {quoted(info.name)} overlap")
        previous = info
    return placed


@dataclass(frozen=True)
class GGUFContainer:
    metadata: dict[str, object]  # every key -> str, int, float, bool, or a list of those
    tensors: dict[str, TensorInfo]
    data: mmap.mmap  # the whole file, read-only


def read_container(path: Path) -> GGUFContainer:
    """The checked metadata and tensor index of the GGUF file at `path`; the file stays mapped."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) < 24:
                raise CorruptCheckpointError(f"{path}: not a valid GGUF file (shorter than its 24-byte header)")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read: {e.strerror or e}") from None
    cur = _Cursor(data, path)
    if data[:4] != MAGIC:
        raise cur.error("it does not start with the bytes 'GGUF'")
    cur.pos = 4
    version = cur.scalar("<I", "the version")
    if version not in VERSIONS:
        raise cur.error(f"version {version}; lucebox reads versions {' and '.join(map(str, VERSIONS))}")
    n_tensors = cur.scalar("<Q", "the tensor count")
    n_keys = cur.scalar("<Q", "the key count")
    # the smallest key: an 8-byte length, a type, a byte; the smallest tensor entry: 32 bytes
    for n, least, limit, what in ((n_keys, 13, MAX_KEYS, "keys"), (n_tensors, 32, MAX_TENSORS, "tensors")):
        if n > min(limit, (len(data) - cur.pos) // least):
            raise cur.error(f"the header claims {n} {what}, more than the file could hold or lucebox's limit {limit}")
    metadata = _Metadata(cur).read(n_keys)
    entries = [_tensor_info(cur) for _ in range(n_tensors)]
    return GGUFContainer(metadata, _place(cur, entries, _alignment(cur, metadata)), data)
