"""Size and depth bounds on JSON Schemas and grammars, checked in Python before llguidance sees them.

llguidance (1.9.1) compiles schemas and grammars by recursion in native code, and a deep enough
recursion overflows the thread's stack: a segfault that ends the whole process (the server with
every request in it). Measured with 8 MiB of stack (`ulimit -s` 8192, the main thread and a default
thread alike), the compile crashed at
- a flat chain of ~2,600 `$ref`s ({"$ref": next} each): weight ~5,200 below;
- chains of ~650-700 `$ref`s, each through two levels of additionalProperties (weight ~2,700, the
  lowest seen), through an object and an array (~3,300) or through nested anyOf (~4,000);
- a chain of ~2,800 Lark rules (`r0: r1`, `r1: r2`, ...), and of 3,000-5,000 GBNF rules;
- a schema nested 5,000 objects deep (as text, llguidance's own JSON reader stops at 128).
Real schemas and grammars weigh tens to a few hundred; MAX_WEIGHT sits over 3x under every crash,
and the compiles run on a 64 MiB stack (`native`), 8x the one measured, whatever the caller's.

A schema's weight is an upper bound on how deep the compiler can go: the schema's own nesting plus,
for each distinct `$ref` target, one hop and the target's nesting (a path through references meets
a target once: the compiler reuses what it has compiled). A grammar's weight is its rule count plus
the weight of its heaviest embedded `%json` schema (a schema is a leaf: it refers to no rule).
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote

from lucebox.bounded_json import MAX_DEPTH
from lucebox.errors import GrammarError

MAX_WEIGHT = 800
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_MESSAGE_CHARS = 300
# A rule's head at the start of a line: `name:`, `?name:`, `NAME.2:`, `name[stop=""]:` (Lark; GBNF is
# translated to Lark first). Alternatives go on `|` lines and JSON keys are quoted: neither matches.
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?[0-9]+)?[ \t]*(?:\[[^\]\n]*\])?[ \t]*:(?!:)", re.M)
_GBNF_RULE_HEAD = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.M)
_EMBEDDED_JSON = re.compile(r"%json\s*(?=\{)")


def one_line(message: str) -> str:
    """The grammar engine's message as one line: its first (a caret block under it goes), cut short."""
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "no reason given")
    return first if len(first) <= _MESSAGE_CHARS else first[:_MESSAGE_CHARS] + "..."


def check_schema(schema: dict, field: str) -> int:
    """`schema` within the bounds, its `$ref`s free of loops that write nothing; its weight. A
    GrammarError naming `field` otherwise."""
    nodes = _nodes(schema, field)
    root_depth = max(depth for _, depth, _ in nodes)
    nested_ids = any(isinstance(node.get("$id"), str) for node, _, pointer in nodes if pointer)
    targets: dict[str, dict | None] = {}
    for node, _, _ in nodes:
        for key in _REF_KEYS:
            if isinstance(node.get(key), str):
                ref = node[key]
                targets.setdefault(ref, None if nested_ids else _resolve(schema, ref))
    weight = root_depth + sum(1 + (root_depth if t is None else _depth(t)) for t in targets.values())
    if weight > MAX_WEIGHT:
        raise GrammarError(field, f"is too large for the grammar engine: its nesting and {len(targets)} $ref "
                                  f"targets weigh {weight}, at most {MAX_WEIGHT} (each $ref target counts 1 plus "
                                  "its own nesting); share definitions or flatten the schema")
    if not nested_ids:
        _check_ref_loops(schema, nodes, field)
        _check_choices_write_something(schema, nodes, field)
    return weight


def check_grammar(lark: str, field: str) -> None:
    """Lark text within the bounds (rules, and the schemas it embeds with `%json`); GBNF text too,
    by its rule count (before its translation to Lark, which takes seconds on a crafted one)."""
    rules = max(len(_RULE_HEAD.findall(lark)), len(_GBNF_RULE_HEAD.findall(lark)))
    heaviest = max((check_schema(s, field) for s in _embedded_schemas(lark, field)), default=0)
    if rules + heaviest > MAX_WEIGHT:
        raise GrammarError(field, f"is too large for the grammar engine: {rules} rules"
                                  + (f" and a %json schema of weight {heaviest}" if heaviest else "")
                                  + f", at most {MAX_WEIGHT} together; merge rules (a chain of rules that each "
                                    "name the next is one rule)")


def _nodes(schema: dict, field: str) -> list[tuple[dict, int, str]]:
    """Every object in `schema` as (object, depth, JSON pointer), walked without recursion; nesting
    past MAX_DEPTH is a GrammarError (arrays and objects counted together, as `bounded_json`)."""
    found, stack = [], [(schema, 1, "")]
    while stack:
        value, depth, pointer = stack.pop()
        if depth > MAX_DEPTH:
            raise GrammarError(field, f"nests arrays and objects more than {MAX_DEPTH} deep, the most lucebox "
                                      "reads; flatten it (shared parts as $defs)")
        if isinstance(value, dict):
            found.append((value, depth, pointer))
            items = ((str(k).replace("~", "~0").replace("/", "~1"), v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((str(i), v) for i, v in enumerate(value))
        else:
            continue
        stack.extend((v, depth + 1, f"{pointer}/{k}") for k, v in items if isinstance(v, (dict, list)))
    return found


def _depth(value) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _resolve(schema: dict, ref: str):
    """The object a local reference ("#", "#/$defs/a") points to in `schema`; None for any other."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    target = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target if isinstance(target, dict) else None


def _check_ref_loops(schema: dict, nodes, field: str) -> None:
    """A `$ref` that comes back to itself through `$ref`s and `allOf`s only (`{"$ref": "#"}`, a -> b -> a)
    asks for a value before writing any of it: no JSON value follows the schema."""
    pointer_of = {id(node): "#" + pointer for node, _, pointer in nodes}

    def next_nodes(node: dict) -> list[dict]:
        found = [_resolve(schema, node[k]) for k in _REF_KEYS if isinstance(node.get(k), str)]
        found += node["allOf"] if isinstance(node.get("allOf"), list) else []
        return [n for n in found if isinstance(n, dict)]

    state: dict[int, str] = {}  # id(node) -> "open" (on the path walked now) | "done" (no loop through it)
    for start, _, _ in nodes:
        if id(start) in state:
            continue
        path, branches = [start], [iter(next_nodes(start))]
        state[id(start)] = "open"
        while branches:
            step = next(branches[-1], None)
            if step is None:
                state[id(path.pop())] = "done"
                branches.pop()
            elif state.get(id(step)) == "open":
                loop = path[[id(n) for n in path].index(id(step)):] + [step]
                shown = " -> ".join(pointer_of.get(id(n), "?") for n in loop)
                raise GrammarError(field, f"has a $ref loop that writes nothing ({shown}): the schema refers back "
                                          "to itself before any value, so no JSON value follows it; end the loop "
                                          "with a schema that writes something (a type, properties, items)")
            elif id(step) not in state:
                state[id(step)] = "open"
                path.append(step)
                branches.append(iter(next_nodes(step)))


_COMBINATORS = {*_REF_KEYS, "allOf", "anyOf", "oneOf"}
_ANNOTATIONS = {"$defs", "definitions", "$schema", "$id", "$anchor", "$comment", "title", "description", "default",
                "examples", "deprecated", "readOnly", "writeOnly"}


def _check_choices_write_something(schema: dict, nodes, field: str) -> None:
    """A schema made only of `$ref`, `allOf`, `anyOf` and `oneOf` writes a value only through one of its
    ways down; where every way comes back to it (`{"anyOf": [{"$ref": "#"}]}`) no JSON value follows.
    Found as what no walk reaches a writing schema from (a worklist over the ways down: linear in the
    schema, whatever a crafted one nests)."""
    pure = {id(node): (node, pointer) for node, _, pointer in nodes
            if set(node) & _COMBINATORS and set(node) <= _COMBINATORS | _ANNOTATIONS}
    waiting: dict[int, list[tuple[int, int]]] = {}  # a pure node's id -> (a node waiting on it, which way)
    open_ways: dict[int, set[int]] = {}  # a pure node's id -> its ways not yet known to write
    for key, (node, _) in pure.items():
        ways = [[_resolve(schema, node[k])] for k in _REF_KEYS if isinstance(node.get(k), str)]
        ways += [[n] for n in node["allOf"]] if isinstance(node.get("allOf"), list) else []
        ways += [node[k] for k in ("anyOf", "oneOf") if isinstance(node.get(k), list) and node[k]]
        open_ways[key] = set()
        for i, choices in enumerate(ways):
            if all(isinstance(c, dict) and id(c) in pure for c in choices):  # else one choice writes (or the
                open_ways[key].add(i)                                        # engine judges an odd one)
                for c in choices:
                    waiting.setdefault(id(c), []).append((key, i))
    done = [key for key, ways in open_ways.items() if not ways]
    while done:
        for key, way in waiting.get(done.pop(), ()):
            if way in open_ways[key]:
                open_ways[key].discard(way)
                if not open_ways[key]:
                    done.append(key)
    stuck = ["#" + pure[key][1] for key, ways in open_ways.items() if ways]
    if stuck:
        raise GrammarError(field, f"has a $ref loop that writes nothing ({', '.join(stuck[:3])}): every way "
                                  "through its $ref, allOf, anyOf and oneOf comes back to itself before any value, "
                                  "so no JSON value follows it; give one branch a schema that writes something")


def _embedded_schemas(lark: str, field: str):
    """The JSON Schemas a Lark grammar embeds (`%json {...}`); text there that is not JSON is left to
    the engine's own error."""
    decoder = json.JSONDecoder()
    for match in _EMBEDDED_JSON.finditer(lark):
        try:
            value, _ = decoder.raw_decode(lark, match.end())
        except RecursionError:
            raise GrammarError(field, f"embeds a %json schema nested more than {MAX_DEPTH} deep") from None
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value
