"""One request's grammar state, in step with the tokens the cache commits.

Contract: the matcher has consumed exactly the request's committed tokens (the first one, then
each round's accepted drafts and next token: `commit`). Before a round's step, `cut` keeps the
drafts up to the first one the grammar forbids, and `forced` offers the tokens the grammar forces
as drafts of their own (drafts the grammar refuses can never be kept).
After the step, `constrain` computes on the host one token mask per row of the step (row 0 after
the committed tokens, row i after drafts d1..di, consumed and then rolled back), uploads them as
one bitmask and masks the logits with it: the decision (greedy argmax, the race, or the
acceptance rule) then runs on the masked target distribution, so a constrained round decides
exactly as constrained plain decoding would. On a GPU the masks are computed while the step runs.

Masked logits are MASKED, not -inf: finite, so a non-finite logit still means broken weights
(`speculative.decide.check_finite`), yet so far below any real logit that softmax gives them
exactly 0, also after a repetition penalty (at most x1000) or a temperature (at least 1e-5).
"""

from __future__ import annotations

import re
import time

import torch

from lucebox.constrained.bounds import one_line
from lucebox.constrained.native import on_compile_stack
from lucebox.constrained.spec import Constraint, llguidance
from lucebox.constrained.vocabulary import grammar_tokenizer
from lucebox.draft import Draft
from lucebox.errors import GrammarError, LuceboxError

MASKED = -1e30
BITS = 32  # llguidance's masks: token t is bit t % 32 of int32 word t // 32
# llguidance's errors when a grammar is past what its parser follows (its ParserLimits): not a bug
_ENGINE_LIMITS = ("Current row has", "Too many items", "ParserTooComplex", "LexerTooComplex",
                  "too many expressions constructed")  # the last: a regex (a pattern) the lexer cannot expand
_NO_ROLLBACK = re.compile(r"\b(?:stop|max_tokens)\s*=")


class GrammarState:
    def __init__(self, constraint: Constraint, tokenizer, vocab_size: int, eos_ids: tuple[int, ...],
                 device: torch.device):
        """`tokenizer`: the model's (`text.tokenizer.Tokenizer`); `eos_ids`: the tokens that end the output."""
        self._vocabulary, self._grammar = grammar_tokenizer(tokenizer, vocab_size, eos_ids), constraint.grammar
        self.matcher = self._new_matcher()
        self._committed: list[int] = []  # what the matcher consumed, to rebuild it (`_restore`)
        self._unfollowed: tuple[int, str] | None = None  # (the first mask row a draft walk left empty, why)
        if self.matcher.is_error():
            raise GrammarError(constraint.field,
                               f"the grammar engine cannot compile it: {one_line(self.matcher.get_error())}")
        self.vocab_size, self.device, self.eos_ids = vocab_size, device, frozenset(eos_ids)
        self.field = constraint.field
        # A lexeme with stop=... or max_tokens=... (Lark's `gen[stop="\n"]`) cannot be rolled back: the
        # drafts' rows are then walked on a copy of the matcher (a few microseconds, growing with the
        # output), else consumed and rolled back.
        self._copies = _NO_ROLLBACK.search(constraint.grammar) is not None
        words = (vocab_size + BITS - 1) // BITS
        self._host = torch.zeros((1, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._shifts = torch.arange(BITS, dtype=torch.int32, device=device)
        self.mask_seconds, self.masks = 0.0, 0  # host time spent computing masks, and how many

    def cut(self, draft: Draft) -> Draft:
        """The draft up to (not including) its first token the grammar forbids."""
        n = self.matcher.validate_tokens(draft.tokens) if draft.tokens else 0
        return draft.first(n)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens that write the bytes the grammar forces next (a JSON key after its
        quote, the punctuation between fields): drafts the masked target keeps, unless it writes the
        same bytes with other tokens. Verified like any draft, so they never change the output."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def constrain(self, logits: torch.Tensor, draft: Draft) -> tuple[torch.Tensor, Draft]:
        """logits (k+1, V) of a step over [last, d1..dk] masked row by row, and the draft with its
        distributions q (k, V) restricted to the tokens the grammar allows there and renormalized
        (what a sampled draft of a constrained drafter is drawn from: the acceptance rule is then exact)."""
        allowed = self.allowed(draft.tokens)  # (k+1, V) bool, on the device
        masked = logits.float().masked_fill(~allowed, MASKED)
        if draft.q is None or not draft.tokens:
            return masked, draft
        q = draft.q * allowed[: len(draft.tokens)]
        return masked, Draft(draft.tokens, q / q.sum(-1, keepdim=True), draft.confidence, draft.copied)

    def allowed(self, drafts: list[int]) -> torch.Tensor:
        """(k+1, V) bool on the device: which tokens the grammar allows after the committed tokens
        and each draft prefix d1..di (the drafts are allowed ones: `cut`)."""
        start = time.perf_counter()
        rows = len(drafts) + 1
        if self._host.shape[0] < rows:
            self._host = torch.zeros((rows, self._host.shape[1]), dtype=torch.int32,
                                     pin_memory=self._host.is_pinned())
        m, row_bytes = self.matcher, self._host.shape[1] * 4
        m.unsafe_compute_mask_ptr(self._host[0].data_ptr(), row_bytes)  # row 0, written in place
        self._unfollowed = None
        followed = self._walk_drafts(drafts, row_bytes) if drafts else rows
        m = self.matcher  # a new one if the walk left the old one in error
        if m.is_error() or not self._host[:followed].any(dim=1).all():
            raise self._broken("every token", m)
        self.mask_seconds += time.perf_counter() - start
        self.masks += rows
        words = self._host[:rows].to(self.device, non_blocking=True)  # (rows, W): one upload
        bits = (words.unsqueeze(-1) >> self._shifts) & 1  # (rows, W, 32)
        return bits.view(rows, -1)[:, : self.vocab_size].bool()

    def _walk_drafts(self, drafts: list[int], row_bytes: int) -> int:
        """Rows 1..k of the mask (after each draft prefix); how many rows of the step it could follow.
        Past a draft the engine cannot follow (a parser limit: a rule of thousands of alternatives, a
        schema with no finite value) the rows stay empty and the matcher is rebuilt: plain decoding
        meets the same error exactly when it commits that draft, and so does this round (`commit`)."""
        m = self.matcher
        walker = m.deep_copy() if self._copies else m
        for i, token in enumerate(drafts, 1):
            if walker.consume_token(token):
                walker.unsafe_compute_mask_ptr(self._host[i].data_ptr(), row_bytes)
            if walker.is_error():
                self._host[i: len(drafts) + 1].zero_()
                self._unfollowed = (i, walker.get_error())  # what `commit` meets if this round keeps draft i
                if walker is m:
                    self._restore()  # llguidance cannot roll an error back
                return i
        if walker is m:
            m.rollback(len(drafts))
        return len(drafts) + 1

    def _new_matcher(self):
        return on_compile_stack(llguidance().LLMatcher, self._vocabulary, self._grammar, log_level=0)

    def _restore(self) -> None:
        """A new matcher that has consumed the committed tokens; drafts walk on copies from now on."""
        self.matcher = self._new_matcher()
        self.matcher.consume_tokens(self._committed)
        self._copies = True

    def commit(self, tokens: list[int]) -> None:
        """The round's committed tokens (chosen under the mask, so each is allowed). An EOS the
        complete grammar allowed ends the request: the matcher, stopped, takes nothing more."""
        for row, token in enumerate(tokens):  # token `row` was chosen from mask row `row`
            if self._unfollowed is not None and row >= self._unfollowed[0]:
                # chosen from a row the walk left empty: the error plain decoding meets after these drafts
                raise self._broken(f"a committed token ({token})", self.matcher, self._unfollowed[1])
            if token in self.eos_ids and self.matcher.is_accepting():
                return
            if not self.matcher.consume_token(token):
                raise self._broken(f"a committed token ({token})", self.matcher)
            self._committed.append(token)

    def stats(self) -> dict:
        return {"grammar_masks": self.masks, "grammar_mask_time_s": self.mask_seconds}

    def _broken(self, what: str, matcher, walk_error: str | None = None) -> LuceboxError:
        """`walk_error`: the error a draft walk met where this round's token was chosen from an empty row."""
        error = one_line(walk_error or matcher.get_error() or "no error reported")
        if any(limit in error for limit in _ENGINE_LIMITS):
            return GrammarError(self.field, f"is more than the grammar engine can follow where the output stands "
                                f"({error[:300]}): give fewer alternatives to one rule, anyOf or enum (at most "
                                "~2,000 in a row of the parse), patterns with smaller repeats, and a schema a finite "
                                "value can follow (a required property that refers back to its own schema has none)")
        # No token writes the bytes the grammar asks for next (a vocabulary without byte fallback
        # meeting text it has no tokens for): llguidance stops with "NoExtension...", or, where its
        # mask let a token through, refuses that token against the bytes it forces.
        if error.startswith("NoExtension") or "forced bytes" in error:
            return GrammarError(self.field, "needs text this model's vocabulary cannot write (no token can "
                                "continue the output where it stands); write the grammar or schema in text the "
                                "tokenizer has tokens for, or use a model whose tokenizer falls back to bytes")
        return LuceboxError(f"the grammar engine refused {what}: {error}; this is a bug in lucebox, please report it")
