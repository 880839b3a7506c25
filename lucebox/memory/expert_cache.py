"""MoE experts in host memory, with a device cache of the experts steps use (`experts_on_host`).

A model whose routed experts do not fit the card keeps them in host memory (pinned, on CUDA) and
gives each MoE layer `slots` device slots. A step reads which experts its rows chose (one host
read per MoE layer, which is why such a model runs its steps eagerly, not as CUDA graphs),
copies the missing ones into the least recently used slots, and runs the backend's MoE kernel
over the slots with the choices renumbered by slot. Every kernel sums a row's k choices in choice
order, whatever the experts' numbers, so the output is the all-on-device one. A step whose rows
choose more experts than there are slots (a prefill chunk, with few slots) runs in consecutive
groups of rows that each fit.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch

from lucebox.errors import InvalidArgumentError
from lucebox.kernels.quant import Weight


@dataclasses.dataclass
class ExpertTraffic:
    """What the caches of every layer did: a hit is a chosen expert already in its slot."""

    hits: int = 0  # (row, choice) pairs whose expert was in its slot
    misses: int = 0  # pairs whose expert was not: several rows choosing one missing expert miss once each
    copies: int = 0  # experts copied in (one per missing expert per step)
    copied_bytes: int = 0

    def since(self, start: ExpertTraffic) -> dict:
        hits, misses = self.hits - start.hits, self.misses - start.misses
        return {"expert_hits": hits, "expert_misses": misses,
                "expert_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
                "expert_copies": self.copies - start.copies,
                "expert_copied_bytes": self.copied_bytes - start.copied_bytes}


def _tensors(w: Weight) -> dict[str, torch.Tensor]:
    """The (E, ...) tensors of an expert stack, by field name ({"": w} for a plain tensor)."""
    if isinstance(w, torch.Tensor):
        return {"": w}
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w)
            if isinstance(getattr(w, f.name), torch.Tensor)}


def _rebuilt(w: Weight, tensors: dict[str, torch.Tensor], experts: int) -> Weight:
    if isinstance(w, torch.Tensor):
        return tensors[""]
    return dataclasses.replace(w, **tensors, shape=(experts, *w.shape[1:]))


def expert_bytes(w: Weight) -> int:
    """Bytes one expert of a stack takes."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(w).values())


def moved(w: Weight, device: torch.device | str, arena: PinnedArena | None = None) -> Weight:
    """A plain or quantized weight on `device`; on the host, in `arena`'s pinned memory if given."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return arena.hold(t) if arena is not None else t.to(device)

    return _rebuilt(w, {k: move(t) for k, t in _tensors(w).items()}, w.shape[0])


class PinnedArena:
    """Pinned host memory for the experts, allocated in blocks of `block` bytes and handed out in
    order. Pinning each tensor on its own would cost more than its size: the caching host
    allocator rounds every allocation up to a power of two (a 268 MB stack would pin 512 MB). A
    block is a power of two, so only the tail of each block is left over."""

    def __init__(self, block: int = 2**31, pin: bool = True):
        self.block, self.pin = block, pin  # pin=False: plain host memory (tests on machines without CUDA)
        self.blocks: list[torch.Tensor] = []
        self.used = block  # of the last block: none yet

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of `t`."""
        size = t.numel() * t.element_size()
        if size > self.block:  # larger than a block: pinned on its own
            return t.to("cpu").pin_memory() if self.pin else t.to("cpu", copy=True)
        start = -(-self.used // 64) * 64  # every tensor starts 64-byte aligned
        if start + size > self.block:
            self.blocks.append(torch.empty(self.block, dtype=torch.uint8, pin_memory=self.pin))
            start = 0
        self.used = start + size
        held = self.blocks[-1][start : start + size].view(t.dtype).view(t.shape)
        held.copy_(t)
        return held

    def nbytes(self) -> int:
        return len(self.blocks) * self.block


def is_routed_expert(name: str) -> bool:
    return name.endswith((".experts_gate_up", ".experts_down"))


class ExpertCache:
    """One MoE layer's experts (gate_up and down stacks) in host memory, `slots` of them on the device."""

    def __init__(self, gate_up: Weight, down: Weight, slots: int, device: torch.device, traffic: ExpertTraffic):
        self.experts = gate_up.shape[0]
        if not 1 <= slots <= self.experts:
            raise InvalidArgumentError(f"an expert cache needs 1 to {self.experts} slots, not {slots}")
        self.host = (gate_up, down)
        self.device, self.traffic = device, traffic
        self.slots = tuple(_rebuilt(w, {k: torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=device)
                                        for k, t in _tensors(w).items()}, slots) for w in self.host)
        self.slot_of: dict[int, int] = {}
        self.recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(slots))  # LRU first
        self.expert_in: list[int | None] = [None] * slots

    @property
    def capacity(self) -> int:
        return len(self.expert_in)

    def nbytes(self) -> int:
        """Device bytes: the slots (the experts in host memory are not counted)."""
        return sum(expert_bytes(w) for w in self.host) * self.capacity

    def moe(self, moe_experts: Callable, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            *args) -> torch.Tensor:
        """`moe_experts(x, gate_up, down, weights, ids, *args)` with this layer's experts."""
        chosen = ids.tolist()  # the one host read: which experts the rows chose
        outputs, layout = [], (len(chosen), self.experts)  # each group computed as the whole step would be
        for start, end in self._row_groups(chosen):
            slot_ids = self._resident(chosen[start:end])
            outputs.append(moe_experts(x[start:end], *self.slots, weights[start:end], slot_ids, *args,
                                       layout_of=layout))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _row_groups(self, chosen: list[list[int]]) -> list[tuple[int, int]]:
        """Consecutive row ranges that each choose at most `capacity` distinct experts."""
        groups, start, seen = [], 0, set()
        for row, experts in enumerate(chosen):
            if len(set(experts)) > self.capacity:
                raise InvalidArgumentError(f"a row chose {len(set(experts))} experts, more than the {self.capacity} "
                                           "slots of the expert cache; give it at least top_k slots")
            if len(seen | set(experts)) > self.capacity:
                groups.append((start, row))
                start, seen = row, set()
            seen |= set(experts)
        groups.append((start, len(chosen)))
        return groups

    def _resident(self, chosen: list[list[int]]) -> torch.Tensor:
        """Slot ids (rows, k) on the device for these choices, after copying in the missing experts."""
        needed = list(dict.fromkeys(e for row in chosen for e in row))
        missing = [e for e in needed if e not in self.slot_of]
        self.traffic.hits += sum(e in self.slot_of for row in chosen for e in row)
        self.traffic.misses += sum(e not in self.slot_of for row in chosen for e in row)
        for expert in needed:  # chosen now: most recently used
            if expert in self.slot_of:
                self.recent.move_to_end(self.slot_of[expert])
        for expert in missing:
            slot = next(iter(self.recent))  # least recently used, never one of `needed` (moved to the end)
            self._load(expert, slot)
            self.recent.move_to_end(slot)
        return torch.tensor([[self.slot_of[e] for e in row] for row in chosen], dtype=torch.int64).to(
            self.device, non_blocking=True)

    def _load(self, expert: int, slot: int) -> None:
        # The slot is free before its copies start and taken after they are queued: an interrupt in
        # between leaves a free slot, never one that claims an expert it does not hold.
        old = self.expert_in[slot]
        if old is not None:
            del self.slot_of[old]
            self.expert_in[slot] = None
        for host, device in zip(self.host, self.slots, strict=True):
            for name, t in _tensors(device).items():
                t[slot].copy_(_tensors(host)[name][expert], non_blocking=True)
        self.traffic.copies += 1
        self.traffic.copied_bytes += sum(expert_bytes(w) for w in self.host)
        self.slot_of[expert], self.expert_in[slot] = slot, expert


def cache_experts(weights: dict, num_layers: int, slots: int, device: torch.device,
                  traffic: ExpertTraffic) -> None:
    """Replace every MoE layer's expert stacks in `weights` (already in host memory) by an
    `ExpertCache` under `layers.{i}.experts`."""
    for i in range(num_layers):
        p = f"layers.{i}."
        if p + "experts_gate_up" in weights:
            gate_up, down = weights.pop(p + "experts_gate_up"), weights.pop(p + "experts_down")
            weights[p + "experts"] = ExpertCache(gate_up, down, slots, device, traffic)
