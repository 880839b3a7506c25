"""`lucebox quantize MODEL OUT --bits 4|8 [--group N]`: a float checkpoint written as a saved
quantized one (`lucebox.checkpoints.quantized`) that `LLM(OUT)` loads without quantizing again.

The checkpoint is streamed: one tensor is read (in its own dtype), quantized and added to the
shard being filled; a shard is written once it holds `SHARD_BYTES`, so memory holds one float
tensor and one shard at most. The codes are those `LLM(MODEL, quantization=...)` computes from the
same float tensor. Everything is written to `OUT.partial`, renamed to OUT when complete
(`lucebox.output`): an existing OUT is refused unless `--overwrite` (and kept until the new one is
complete), an interrupted run leaves OUT as it was, and running again starts over.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from lucebox import __version__
from lucebox.checkpoints.hf_folder import CheckpointIndex, iter_weights, weight_files
from lucebox.checkpoints.loading import checkpoint_sources, describe_model
from lucebox.checkpoints.quantized import FORMAT, METADATA_FILE, VERSION, saved_scheme, stored_fields, tensor_record
from lucebox.errors import InvalidArgumentError
from lucebox.kernels.quant import QuantizedTensor, quantize
from lucebox.models.layout import quantizable, weight_shapes
from lucebox.output import new_folder, output_path

SHARD_BYTES = 2 * 2**30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf")
_DRAFTER_FOLDERS = ("draft", "dflash")  # a paired drafter travels with the model (kept in its dtype)


class _ShardWriter:
    """Fills safetensors shards in order and writes the index that maps each entry to its shard."""

    def __init__(self, out: Path, shard_bytes: int):
        self.out, self.shard_bytes = out, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.shards = 0
        self.bytes = 0

    def add(self, entries: dict[str, torch.Tensor]) -> None:
        self.pending.update(entries)
        self.pending_bytes += sum(t.numel() * t.element_size() for t in entries.values())
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        self.shards += 1
        name = f"model-{self.shards:05d}.safetensors"
        save_file({k: t.contiguous() for k, t in self.pending.items()}, str(self.out / name),
                  metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {"total_size": self.bytes}, "weight_map": self.weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def _scheme(bits: int) -> str:
    if bits not in (4, 8):
        raise InvalidArgumentError(f"--bits {bits} is not supported; use 4 (int4) or 8 (int8)")
    return f"int{bits}"


def _check_group(shapes: dict[str, tuple[int, ...]], scheme: str, group: int | None) -> None:
    """Refuse a group that some weight's inputs cannot be split into, before anything is read."""
    if group is None:
        return
    if group < 1 or (scheme == "int4" and group % 2):
        raise InvalidArgumentError(f"--group {group} must be a positive number of inputs"
                                   + (", and even for int4 (two codes a byte)" if scheme == "int4" else ""))
    for name, shape in shapes.items():
        if quantizable(name) and shape[-1] % group:
            raise InvalidArgumentError(f"--group {group} does not divide the {shape[-1]} inputs of {name}; "
                                       "choose a group that divides every weight's width (e.g. 32)")


def _copy_side_files(source: Path, out: Path) -> None:
    """config.json, tokenizer and generation files, templates; a paired drafter folder as it is."""
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != "model.safetensors.index.json":
            shutil.copyfile(path, out / path.name)
        elif path.is_dir() and path.name in _DRAFTER_FOLDERS:
            shutil.copytree(path, out / path.name)


def quantize_checkpoint(model: str | Path, out: str | Path, bits: int, group: int | None = None,
                        progress=None, shard_bytes: int = SHARD_BYTES, overwrite: bool = False) -> dict:
    """Write `model` (a float checkpoint folder) quantized to `out`; returns a summary.
    `progress(done, total)` is told the bytes of float weights read so far."""
    scheme = _scheme(bits)
    out = output_path(out)  # refused before anything is read: empty, the current folder, home...
    desc = describe_model(model)
    if desc.gguf is not None:
        raise InvalidArgumentError(f"{desc.gguf.file.path} is a GGUF file, already quantized in llama.cpp's block "
                                   "types: load it as it is (LLM(path) or lucebox chat path)")
    if saved_scheme(desc.folder) is not None:
        raise InvalidArgumentError(f"{desc.folder} is already a quantized checkpoint; quantize its float source")
    shapes = weight_shapes(desc.cfg)
    _check_group(shapes, scheme, group)
    index = CheckpointIndex(weight_files(desc.folder))
    sources, unloaded = checkpoint_sources(desc)
    started = time.perf_counter()
    with new_folder(out, "lucebox quantize", overwrite=overwrite, reads=(desc.folder,)) as partial:
        writer, records, read = _ShardWriter(partial, shard_bytes), {}, 0
        for name, tensor in iter_weights(index, sources, shapes, None, torch.device("cpu"), unloaded, progress):
            read += tensor.numel() * tensor.element_size()
            stored: torch.Tensor | QuantizedTensor = quantize(tensor, scheme, group) if quantizable(name) else tensor
            records[name] = tensor_record(stored)
            writer.add(stored_fields(name, stored) if isinstance(stored, QuantizedTensor) else {name: stored})
            del tensor, stored
        writer.close()
        _copy_side_files(desc.folder, partial)
        metadata = {"format": FORMAT, "version": VERSION, "scheme": scheme, "group": group, "asymmetric": False,
                    "quantized_by": f"lucebox {__version__}", "tensors": records}
        (partial / METADATA_FILE).write_text(json.dumps(metadata, indent=1) + "\n")
    return {"out": str(out), "scheme": scheme, "group": group, "tensors": len(records), "read_bytes": read,
            "written_bytes": writer.bytes, "shards": writer.shards, "seconds": time.perf_counter() - started}


def add_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a float checkpoint as a saved int4/int8 one that loads as it is")
    p.add_argument("model", help="float (bf16/fp16/fp32) Hugging Face model folder")
    p.add_argument("out", help="new folder for the quantized checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (kept as it was until the new checkpoint is complete)")
    p.add_argument("--bits", type=int, required=True, help="4 (int4, symmetric) or 8 (int8)")
    p.add_argument("--group", type=int, default=None,
                   help="inputs per scale (e.g. 32, 64, 128); default: 128 for int4 (or the largest of 64, 32 that "
                        "divides), a whole row for int8")


@contextlib.contextmanager
def _read_progress() -> Iterator[Callable[[int, int], None]]:
    """`progress(done, total)` for `quantize_checkpoint`: a bar on stderr shown from the first bytes
    read, so a refusal before then (a bad OUT, a bad --group) stays one error line."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    bar = Progress(TextColumn("[bold]quantizing"), BarColumn(), DownloadColumn(), console=Console(stderr=True),
                   transient=True)
    task = None

    def update(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task("read", total=total)
        bar.update(task, completed=done, total=total)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


def command(args) -> int:
    with _read_progress() as progress:
        summary = quantize_checkpoint(args.model, args.out, args.bits, args.group, progress,
                                      overwrite=args.overwrite)
    gib = 2**30
    print(f"wrote {summary['out']}: {summary['tensors']} tensors as {summary['scheme']}, "
          f"{summary['read_bytes'] / gib:.2f} GiB read, {summary['written_bytes'] / gib:.2f} GiB written in "
          f"{summary['shards']} shard(s), {summary['seconds']:.1f} s")
    return 0
