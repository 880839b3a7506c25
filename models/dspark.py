"""DSpark heads on a DFlash drafter (the Speculators library's `dspark` type): two small heads that
read what the DFlash backbone already computed.

- Markov head: the embedding of the previous token (`markov_w1`, (V, r)) projected back to the
  vocabulary (`markov_w2`, (V, r)) and added to a block position's logits. The backbone drafts all
  positions at once and cannot see its own drafts; this bias lets position j depend on the draft
  chosen at j - 1 (position 1's previous token is the block's anchor `last`), one cheap step per
  position after the one backbone pass.
- Confidence head: a linear map of [the position's final drafter hidden ; the Markov embedding
  of its previous token] (the public default, `confidence_head_with_markov`; the hidden alone
  when that is off) to one logit; its sigmoid is the predicted probability that the draft is kept,
  which becomes `Draft.confidence`.

The heads live in the drafter's weight dict under the names of `head_shapes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lucebox.errors import DraftModelError

# The public layout's keys and their defaults when a config leaves them out (speculators 0.9.0).
HEAD_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                 "confidence_head_with_markov": True}


@dataclass(frozen=True)
class DSparkConfig:
    markov_rank: int  # 0: no Markov head
    confidence: bool  # a confidence head
    confidence_with_markov: bool  # its input is [hidden ; Markov embedding of the previous token]


def heads_config(raw: dict) -> DSparkConfig:
    """The heads a config's DSpark keys describe; what lucebox cannot run is a DraftModelError naming the key."""
    values = {**HEAD_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    rank = values["markov_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 65536:
        raise DraftModelError(f"drafter config.json: markov_rank must be an integer in 0..65536, not {rank!r}")
    if values["markov_head_type"] != "vanilla":
        raise DraftModelError(f"drafter config.json: markov_head_type {values['markov_head_type']!r} is not supported "
                              "(lucebox runs the 'vanilla' first-order Markov head only)")
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(values[key], bool):
            raise DraftModelError(f"drafter config.json: {key} must be true or false, not {values[key]!r}")
    with_markov = values["enable_confidence_head"] and values["confidence_head_with_markov"]
    if with_markov and rank == 0:
        raise DraftModelError("drafter config.json: confidence_head_with_markov needs a Markov head (markov_rank > 0)")
    return DSparkConfig(rank, values["enable_confidence_head"], with_markov)


def head_shapes(cfg: DSparkConfig, hidden_size: int, vocab_size: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.markov_rank:
        shapes.update(markov_w1=(vocab_size, cfg.markov_rank), markov_w2=(vocab_size, cfg.markov_rank))
    if cfg.confidence:
        shapes.update(confidence_w=(1, hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)),
                      confidence_b=(1,))
    return shapes


def head_sources(cfg: DSparkConfig) -> dict[str, str]:
    """The heads' tensor names in the public layout."""
    names = {"markov_w1": "markov_head.markov_w1.weight", "markov_w2": "markov_head.markov_w2.weight",
             "confidence_w": "confidence_head.proj.weight", "confidence_b": "confidence_head.proj.bias"}
    return {ours: names[ours] for ours in head_shapes(cfg, 1, 1)}


class DSparkHeads:
    """The heads over a drafter's weights. Every method broadcasts: rows (..., V) or (..., H) with
    previous tokens (...), so one call serves a single position, a chain, or a training batch."""

    def __init__(self, cfg: DSparkConfig, weights: dict[str, torch.Tensor]):
        self.cfg, self.w = cfg, weights

    def _embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return F.embedding(prev.long(), self.w["markov_w1"])  # (..., r)

    def position_logits(self, base_logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """A block position's logits (float32) given the token before it (`prev`, a device tensor):
        the backbone's `base_logits` plus the Markov bias of `prev`."""
        if not self.cfg.markov_rank:
            return base_logits.float()
        return base_logits.float() + F.linear(self._embedding(prev), self.w["markov_w2"]).float()

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """The confidence head's logit (float32, (...)) for positions with final hidden `hidden`
        (..., H) after `prev` (...); None without a confidence head."""
        if not self.cfg.confidence:
            return None
        x = hidden.to(self.w["confidence_w"].dtype)
        if self.cfg.confidence_with_markov:
            x = torch.cat([x, self._embedding(prev).to(x.dtype)], dim=-1)
        return F.linear(x, self.w["confidence_w"], self.w["confidence_b"]).squeeze(-1).float()

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """The predicted probability (in [0, 1]) that each position's draft is kept; None without the head."""
        logit = self.confidence_logit(hidden, prev)
        return None if logit is None else torch.sigmoid(logit)
