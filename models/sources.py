"""Where each of our tensors comes from in a checkpoint.

A source is a checkpoint tensor name (`str`), a concatenation along dim 0 (`Cat`, e.g. gate and up
projections fused into one matrix), a stack along a new dim 0 (`Stack`, e.g. 256 experts into one
3-D tensor), or alternatives (`AnyOf`, e.g. per-expert tensors or an already fused tensor) of which
the first one whose tensors all exist is used.

A checkpoint tensor that no source reads stops the load (UnexpectedTensorError), unless an
`Unloaded` rule names it: a tensor the architecture knowingly leaves unread, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Cat:
    parts: tuple[Source, ...]
    sizes: tuple[int, ...]  # rows each part contributes along dim 0


@dataclass(frozen=True)
class Stack:
    parts: tuple[Source, ...]


@dataclass(frozen=True)
class AnyOf:
    options: tuple[Source, ...]


Source = str | Cat | Stack | AnyOf


@dataclass(frozen=True)
class Unloaded:
    """Checkpoint tensors a load knowingly leaves unread: the tensor `name`, or every tensor under
    it when it ends with '.'. `why` is told to the user when such tensors are skipped (`quiet`: not
    told, for a skip as routine as a tied lm_head copy)."""

    name: str
    why: str
    quiet: bool = False

    def covers(self, tensor: str) -> bool:
        return tensor.startswith(self.name) if self.name.endswith(".") else tensor == self.name


def renamed(source: Source, rename: Callable[[str], str]) -> Source:
    """`source` with `rename` applied to each checkpoint name it reads."""
    if isinstance(source, str):
        return rename(source)
    if isinstance(source, AnyOf):
        return AnyOf(tuple(renamed(option, rename) for option in source.options))
    return replace(source, parts=tuple(renamed(part, rename) for part in source.parts))


def leaf_names(source: Source, first_option: bool = False) -> Iterator[str]:
    """Checkpoint names a source reads (for `AnyOf`, all options, or only the first)."""
    if isinstance(source, str):
        yield source
    elif isinstance(source, AnyOf):
        for option in source.options[:1] if first_option else source.options:
            yield from leaf_names(option, first_option)
    else:
        for part in source.parts:
            yield from leaf_names(part, first_option)


def first_available(source: Source, exists: Callable[[str], bool]) -> Source | None:
    """The source with every `AnyOf` replaced by its first fully present option, or None."""
    if isinstance(source, str):
        return source if exists(source) else None
    if isinstance(source, AnyOf):
        for option in source.options:
            picked = first_available(option, exists)
            if picked is not None:
                return picked
        return None
    parts = tuple(first_available(p, exists) for p in source.parts)
    if any(p is None for p in parts):
        return None
    return Cat(parts, source.sizes) if isinstance(source, Cat) else Stack(parts)


def to_checkpoint(tensor, source: Source) -> dict:
    """The inverse of reading: our tensor split into the checkpoint tensors of `source` (for
    `AnyOf`, its first option), so saved models use the published names and layouts."""
    if isinstance(source, str):
        return {source: tensor.contiguous()}
    if isinstance(source, AnyOf):
        return to_checkpoint(tensor, source.options[0])
    pieces = tensor.split(list(source.sizes), dim=0) if isinstance(source, Cat) else tensor.unbind(0)
    out = {}
    for piece, part in zip(pieces, source.parts, strict=True):
        out.update(to_checkpoint(piece, part))
    return out
