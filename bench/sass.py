"""Read a kernel's loops and resources out of its SASS (`cuobjdump -sass` / `-res-usage` listings).

The hot loop of a streaming kernel is an innermost loop: a back edge (a branch to a block that
dominates it) whose body holds no other loop. Its cost per iteration is the instructions on the
longest path from the loop's header to the back edge, so the two arms of an `if` inside the loop
(MoE's shared expert / routed expert tiles) count once, the longer one, not both.
`BRA.DIV` (taken only when a warp arrives diverged at a shuffle) is counted as not taken and
`BRA.CONV` (taken when it arrives converged) as always taken: the slow code for diverged warps is
not part of a normal iteration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")
TARGET = re.compile(r"(0x[0-9a-f]+)\s*$")
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str  # without the predicate

    predicated: bool = False

    @property
    def opcode(self) -> str:
        return self.text.split()[0]

    def target(self) -> int | None:
        """The address a BRA or CALL goes to (None for others, and for BRA.DIV: see the module doc)."""
        op = self.opcode.split(".")
        if op[0] not in ("BRA", "CALL") or "DIV" in op:
            return None
        found = TARGET.search(self.text)
        return int(found.group(1), 16) if found else None

    def falls_through(self) -> bool:
        op = self.opcode.split(".")
        if op[0] == "BRA" and ("DIV" in op or "CONV" in op):
            return "DIV" in op
        return self.predicated or op[0] not in ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX")


@dataclass(frozen=True)
class Loop:
    header: int  # address of the first instruction of the loop's header block
    latch: int  # address of the back-edge branch
    path_instructions: int  # on the longest path from the header through the back edge
    body_instructions: int  # every instruction of the loop body, all arms of its branches


def parse_sass(listing: str) -> list[Instruction]:
    """The instructions of the first function in a `cuobjdump -sass` listing."""
    found, last = [], -1
    for match in INSTRUCTION.finditer(listing):
        address, text = int(match.group(1), 16), match.group(2).strip()
        if address <= last:  # a second function starts over at 0
            break
        last = address
        predicate = PREDICATE.match(text)
        found.append(Instruction(address, text[predicate.end():] if predicate else text, bool(predicate)))
    return found


def parse_resources(listing: str) -> dict:
    """Registers per thread, stack, shared and local (spill) bytes from `cuobjdump -res-usage`."""
    reg, stack, shared, local = (int(x) for x in RESOURCES.search(listing).groups())
    return {"registers": reg, "stack_bytes": stack, "static_shared_bytes": shared, "local_bytes": local}


def _blocks(code: list[Instruction]) -> tuple[list[range], dict[int, list[int]]]:
    """Basic blocks (index ranges into `code`) and each block's successors (block numbers)."""
    index = {ins.address: i for i, ins in enumerate(code)}
    leaders = {0}
    for i, ins in enumerate(code):
        if ins.target() is not None or not ins.falls_through():
            leaders.add(i + 1)
            if ins.target() in index:
                leaders.add(index[ins.target()])
    starts = sorted(s for s in leaders if s < len(code))
    blocks = [range(s, e) for s, e in zip(starts, [*starts[1:], len(code)], strict=True)]
    block_of = {b.start: n for n, b in enumerate(blocks)}
    successors = {}
    for n, b in enumerate(blocks):
        last = code[b.stop - 1]
        nexts = [block_of[index[last.target()]]] if last.target() in index else []
        if last.falls_through() and b.stop < len(code):
            nexts.append(n + 1)
        successors[n] = nexts
    return blocks, successors


def _dominators(successors: dict[int, list[int]]) -> dict[int, set[int]]:
    reachable, todo = {0}, [0]
    while todo:
        for s in successors[todo.pop()]:
            if s not in reachable:
                reachable.add(s)
                todo.append(s)
    preds = {n: [p for p in reachable if n in successors[p]] for n in reachable}
    dom = {n: ({0} if n == 0 else set(reachable)) for n in reachable}
    changed = True
    while changed:
        changed = False
        for n in sorted(reachable - {0}):
            new = {n} | set.intersection(*(dom[p] for p in preds[n]))
            if new != dom[n]:
                dom[n], changed = new, True
    return dom


def find_loops(code: list[Instruction]) -> list[Loop]:
    """Every innermost loop of the code, by header address."""
    blocks, successors = _blocks(code)
    dom = _dominators(successors)
    bodies: dict[int, set[int]] = {}
    latches: dict[int, list[int]] = {}
    for n in dom:
        for h in successors[n]:
            if h in dom[n]:  # a back edge n -> h
                body, todo = {h, n}, [n] if n != h else []  # walk back from the latch, never past h
                while todo:
                    m = todo.pop()
                    for p in dom:
                        if m in successors[p] and p not in body:
                            body.add(p)
                            todo.append(p)
                bodies.setdefault(h, set()).update(body)
                latches.setdefault(h, []).append(n)
    loops = []
    for h, body in bodies.items():
        if any(other != h and other in body for other in bodies):
            continue  # holds an inner loop
        longest: dict[int, int] = {}

        def path(n: int, h=h, body=body, longest=longest) -> int:
            if n not in longest:
                inside = [path(s) for s in successors[n] if s in body and s != h]
                longest[n] = len(blocks[n]) + max(inside, default=0)
            return longest[n]

        loops.append(Loop(code[blocks[h].start].address, code[blocks[max(latches[h])].stop - 1].address,
                          path(h), sum(len(blocks[n]) for n in body)))
    return sorted(loops, key=lambda loop: loop.header)
