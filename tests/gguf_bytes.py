"""A GGUF file as an editable layout (header, metadata, tensor index, data) written back byte by
byte, so tests can make files no well-behaved writer would: wrong counts and lengths, duplicate
keys, misaligned or overlapping offsets. Read with the `gguf` package's own reader; written here."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf

STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
UINT32, INT32, FLOAT32, BOOL = 4, 5, 6, 7


@dataclass
class Field:
    key: str
    kind: int  # a GGUF value type; ARRAY with `item` the elements' type
    value: object
    item: int | None = None
    declared: int | None = None  # the length or count written, when it is to differ from the value's
    type_written: int | None = None  # the value type written, when it is to differ from `kind`


@dataclass
class TensorRecord:
    name: str
    dims: list[int]  # GGUF order: row length first
    type_id: int
    offset: int  # relative to the data section


@dataclass
class Layout:
    fields: list[Field]
    tensors: list[TensorRecord]
    data: bytes
    version: int = 3
    alignment: int = 32
    counts: dict[str, int] = field(default_factory=dict)  # declared counts that differ from the lists

    def get(self, key: str) -> Field:
        return next(f for f in self.fields if f.key == key)

    def tensor(self, name: str) -> TensorRecord:
        return next(t for t in self.tensors if t.name == name)


def read_layout(path: Path) -> Layout:
    reader = gguf.GGUFReader(path)
    fields = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = int(f.types[0])
        fields.append(Field(name, kind, f.contents(), int(f.types[1]) if kind == ARRAY else None))
    start = reader.data_offset
    tensors = [TensorRecord(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - start)
               for t in reader.tensors]
    return Layout(fields, tensors, bytes(reader.data[start:]))


def _string(text: str | bytes, declared: int | None = None) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw


def _value(kind: int, value: object, item: int | None, declared: int | None = None) -> bytes:
    if kind not in SCALARS and kind not in (STRING, ARRAY):
        return value  # a type GGUF does not define: its bytes as given
    if kind == STRING:
        return _string(value, declared)
    if kind == ARRAY:
        count = len(value) if declared is None else declared
        return struct.pack("<IQ", item, count) + b"".join(_value(item, v, None) for v in value)
    return struct.pack(SCALARS[kind], value)


def to_bytes(layout: Layout) -> bytes:
    """The file: header (declared counts from `layout.counts` where set), metadata, tensor index,
    padding to the alignment, data."""
    n_tensors = layout.counts.get("tensors", len(layout.tensors))
    n_keys = layout.counts.get("keys", len(layout.fields))
    out = bytearray(b"GGUF" + struct.pack("<IQQ", layout.version, n_tensors, n_keys))
    for f in layout.fields:
        kind = f.kind if f.type_written is None else f.type_written
        out += _string(f.key) + struct.pack("<I", kind) + _value(f.kind, f.value, f.item, f.declared)
    for t in layout.tensors:
        out += _string(t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims, t.type_id, t.offset)
    out += bytes(-len(out) % layout.alignment)
    return bytes(out) + layout.data


def write_layout(layout: Layout, path: Path) -> Path:
    path.write_bytes(to_bytes(layout))
    return path


def _pieces(count: int) -> list[str]:
    """Characters, then "▁"-prefixed letters and digits, then words such as "▁w3": any lowercase
    text encodes, and short words to one piece."""
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    words = [f"▁{a}{b}" for a in "wxyz" for b in "0123456789"] + [f"{a}{b}" for a in chars for b in chars]
    return (["▁", *chars, *(f"▁{c}" for c in chars), *words])[:count]


def tiny_spm_tokenizer(vocab: int) -> list[Field]:
    """tokenizer.ggml.* of a SentencePiece ("llama") tokenizer of `vocab` pieces and a chat template."""
    pieces = ["<unk>", "<s>", "</s>", *_pieces(vocab - 3)]
    return [Field("tokenizer.ggml.model", STRING, "llama"),
            Field("tokenizer.ggml.tokens", ARRAY, pieces, STRING),
            Field("tokenizer.ggml.scores", ARRAY, [0.0] * 3 + [float(len(p)) for p in pieces[3:]], FLOAT32),
            Field("tokenizer.ggml.token_type", ARRAY, [2, 3, 3] + [1] * (vocab - 3), INT32),
            Field("tokenizer.ggml.bos_token_id", UINT32, 1), Field("tokenizer.ggml.eos_token_id", UINT32, 2),
            Field("tokenizer.ggml.unknown_token_id", UINT32, 0),
            Field("tokenizer.chat_template", STRING,
                  "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}")]


def without(path: Path, tmp_path: Path, key: str | None = None, tensor: str | None = None) -> Path:
    """A copy of the GGUF file at `path` lacking the metadata `key` or the `tensor`."""
    layout = read_layout(path)
    layout.fields = [f for f in layout.fields if f.key != key]
    layout.tensors = [t for t in layout.tensors if t.name != tensor]
    return write_layout(layout, tmp_path / "broken.gguf")
