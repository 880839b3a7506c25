"""Constrained decoding: JSON schemas, JSON objects and grammars, through llguidance.

Why llguidance (rather than xgrammar): it installs as one self-contained wheel with no Python
dependencies, while xgrammar's wheel requires transformers (which lucebox never imports at run
time), pydantic and apache-tvm-ffi; and llguidance computes a token mask in tens of microseconds
without precomputing per-state tables (`bench/grammar_mask.py` measures it on the built-in model
against a decode step). Its grammars are Lark, and JSON schemas compile to them.

The pieces, one job each:
- `spec.constraint_from`: a request's `json_schema`, `json_object` or `grammar` argument checked
  and compiled to llguidance's grammar text (bad input: InvalidArgumentError naming the field);
- `bounds`: size and depth bounds a schema or grammar meets before llguidance's native compile sees
  it (which a crafted one could crash), and `native`: the compile run on a stack of known size;
- `vocabulary.grammar_tokenizer`: each token id's bytes, for the matcher (built once per tokenizer);
- `state.GrammarState`: one request's matcher: token masks for the rows of a step (the committed
  tokens, then each draft in turn, rolled back after), drafts cut at the first forbidden token,
  and committed tokens consumed as the cache commits them.
"""

from lucebox.constrained.spec import Constraint, constraint_from
from lucebox.constrained.state import GrammarState

__all__ = ["Constraint", "GrammarState", "constraint_from"]
