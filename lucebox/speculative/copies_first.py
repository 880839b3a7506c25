"""Prompt lookup before a drafter's own pass: when the last `LOOKUP_MIN_MATCH` or more tokens
occurred before, what followed them is the draft (up to the drafter's `max_width`), and the drafter
does not run. Text that repeats itself (a model looping at temperature 0, code restating names, a
long context quoted back) is what a drafter trained on short windows does not copy and a lookup
copies for free. The DFlash and MTP proposers draft so (`CopiesFirst`); `lookup = None` leaves a
drafter's own drafts alone (benchmarks, tests of the drafter)."""

from __future__ import annotations

from lucebox.draft import Draft
from lucebox.sampling import SamplingParams
from lucebox.speculative.ngram import NgramProposer

LOOKUP_MIN_MATCH = 3  # tokens the context's tail must repeat before its continuation is copied as the draft
LOOKUP_PARAMS = SamplingParams()  # a lookup draws nothing; checked once, not each round (~20 us each)


def new_lookup() -> NgramProposer:
    return NgramProposer(min_n=LOOKUP_MIN_MATCH)


class CopiesFirst:
    """The lookup's part of a proposer (`Proposer`'s `propose`, `copies`), around its `own_draft`;
    the proposer keeps `lookup` in step in its `start`, `commit` and `resume`."""

    lookup: NgramProposer | None
    max_width: int

    def propose(self, context: list[int], k: int, params, generator, own_k: int | None = None) -> Draft:
        """Up to k copied tokens, else up to `own_k` (default k) of the drafter's own drafts (a
        sequential drafter's depth: a copy costs next to nothing, a draft a pass)."""
        copied = self.copied(context, k)
        if copied:  # the text repeats itself: copy it (the drafter, trained on short windows, would not)
            return Draft(copied, copied=True)
        return self.own_draft(context, k if own_k is None else own_k, params, generator)

    def copies(self, context: list[int]) -> bool:
        return bool(self.copied(context, 1))

    def copied(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the context's tail (prompt
        lookup; deterministic drafts), or none."""
        if self.lookup is None:
            return []
        return self.lookup.propose(context, min(k, self.max_width), LOOKUP_PARAMS, None).tokens
