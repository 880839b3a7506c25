"""Text corpora for training: the CPython standard library (with a fixed held-out list) or the
user's own files, turned into one token stream of [BOS] file [EOS] documents."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from lucebox.errors import InvalidArgumentError

# Never trained on, by the built-in model, its tokenizer or its drafter: the measurements of
# perplexity, bits per character and speculative speed-up read these. Paths are relative to the
# standard library folder; a module's own tests are held out with it.
HELD_OUT = (
    "csv.py", "difflib.py", "fractions.py", "heapq.py", "ipaddress.py", "shlex.py", "statistics.py",
    "textwrap.py", "json/", "test/test_csv.py", "test/test_difflib.py", "test/test_fractions.py",
    "test/test_heapq.py", "test/test_ipaddress.py", "test/test_shlex.py", "test/test_statistics.py",
    "test/test_textwrap.py", "test/test_json/",
)
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(relative: str) -> bool:
    return any(relative == h or (h.endswith("/") and relative.startswith(h)) for h in HELD_OUT)


def stdlib_files(split: str) -> list[Path]:
    """Sorted `.py` files of the standard library: split "train" (all but `HELD_OUT`) or "held_out"."""
    if split not in ("train", "held_out"):
        raise InvalidArgumentError(f"split must be 'train' or 'held_out', got {split!r}")
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if _SKIPPED_DIRS & set(path.relative_to(root).parts):
            continue
        if _is_held_out(relative) == (split == "held_out"):
            files.append(path)
    return files


def text_files(paths: Sequence[str | Path], suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Files named directly, and those with `suffixes` under folders, sorted; a missing path is an error."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        elif p.is_file():
            found.append(p)
        else:
            raise InvalidArgumentError(f"training data {p} does not exist")
    if not found:
        raise InvalidArgumentError(f"no files ending in {', '.join(suffixes)} under {', '.join(map(str, paths))}")
    return found


# The most text one run reads (~250M tokens): far past what trains on one machine, and a bound
# before a crafted --data (a sparse file of gigabytes) fills host memory
CORPUS_MAX_BYTES = 2**30


def read_texts(files: Iterable[Path]) -> list[str]:
    """UTF-8 text of each file; files that are not UTF-8 are skipped (a few stdlib files are Latin-1).
    Past CORPUS_MAX_BYTES in all, an InvalidArgumentError, found from the files' sizes before reading."""
    texts, total = [], 0
    for f in files:
        try:
            with open(f, "rb") as handle:
                left = CORPUS_MAX_BYTES - total
                if os.fstat(handle.fileno()).st_size > left or len(data := handle.read(left + 1)) > left:
                    raise InvalidArgumentError(f"the training data is over {CORPUS_MAX_BYTES // 2**20} MiB by {f}, "
                                               "the most one run reads; give fewer or smaller files")
            # newlines as text mode reads them (read_text): \r\n and a lone \r are \n
            texts.append(data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n"))
            total += len(data)
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def token_stream(texts: Iterable[str], encode, bos: int, eos: int) -> np.ndarray:
    """[BOS] text [EOS] for every text, concatenated: the documents a model sees in training."""
    parts = [np.asarray([bos, *encode(t), eos], dtype=np.int32) for t in texts]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


class Batches:
    """Random windows of `length + 1` tokens from a stream, seeded: (inputs, labels), both (B, length)."""

    def __init__(self, stream: np.ndarray, batch: int, length: int, seed: int):
        if len(stream) <= length + 1:
            raise InvalidArgumentError(f"the training text has {len(stream)} tokens; it needs more than {length + 1}")
        self.stream = torch.from_numpy(stream.astype(np.int64))
        self.batch, self.length = batch, length
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.stream) - self.length - 1, (self.batch,), generator=self.generator)
        rows = self.stream[starts[:, None] + torch.arange(self.length + 1)]
        return rows[:, :-1], rows[:, 1:]
