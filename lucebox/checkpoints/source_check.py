"""Which checkpoint tensors each of our tensors comes from, chosen among a source's options, and
which checkpoint tensors are refused: every tensor must be read or covered by one of the
architecture's `Unloaded` rules (a vision tower, an MTP head), else the load stops naming it.
"""

from __future__ import annotations

import warnings

from lucebox.errors import LuceboxWarning, MissingTensorError, UnexpectedTensorError
from lucebox.models.sources import Source, Unloaded, first_available, leaf_names

# Tensors some exporters leave behind that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def describe_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def resolve_sources(
    sources: dict[str, Source], shapes: dict[str, tuple[int, ...]],
    index,  # an `hf_folder.CheckpointIndex`: `name in index` and `index.location`
    unloaded: tuple[Unloaded, ...] = (),
) -> dict[str, Source]:
    """Pick one available option per tensor; raise on missing or unexpected checkpoint tensors
    (those no `unloaded` rule covers), and say once which rule skipped tensors, and why."""
    chosen: dict[str, Source] = {}
    missing: list[str] = []
    for name, source in sources.items():
        picked = first_available(source, index.__contains__)
        if picked is None:
            absent = [n for n in leaf_names(source, first_option=True) if n not in index]
            missing.extend(f"{n} (for {name}, expected {describe_shape(shapes[name])} in total)" for n in absent[:3])
        else:
            chosen[name] = picked
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingTensorError(
            f"checkpoint lacks {len(missing)} tensor(s) the architecture needs: "
            f"{'; '.join(missing[:8])}{more}. Is config.json the one that belongs to these weights?"
        )
    used = {n for source in chosen.values() for n in leaf_names(source)}
    unread = [n for n in index.location if n not in used and not n.endswith(_IGNORED_SUFFIXES)]
    extra = sorted(n for n in unread if not any(rule.covers(n) for rule in unloaded))
    if extra:
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise UnexpectedTensorError(
            f"checkpoint has {len(extra)} tensor(s) this architecture does not use: "
            f"{', '.join(extra[:8])}{more}. Does config.json describe these weights?"
        )
    _tell_skipped(unread, unloaded)
    return chosen


def _tell_skipped(unread: list[str], unloaded: tuple[Unloaded, ...]) -> None:
    """One warning per rule that skipped tensors (a vision tower, an MTP head), so a user knows
    what of the checkpoint does not run."""
    for rule in unloaded:
        count = sum(1 for n in unread if rule.covers(n))
        if count and not rule.quiet:
            warnings.warn(f"not loading {count} checkpoint tensor(s) {rule.name}*: {rule.why}",
                          LuceboxWarning, stacklevel=2)
