"""Lossless speculative decoding: proposers (n-gram, draft model, DFlash), exact verification,
adaptive width. See verify.py for the vocabulary every file uses."""

from lucebox.limits import VERIFY_RULES
from lucebox.speculative.decide import decide
from lucebox.speculative.proposer import Draft, Proposer

__all__ = ["VERIFY_RULES", "Draft", "Proposer", "decide"]
