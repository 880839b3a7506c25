"""Turning target logits into the next token: repetition penalty, temperature, top-k, top-p,
min-p (in that order, as transformers' generate applies them), then a seeded draw.

`distribution` returns the final processed probabilities, which is also what speculative
verification must compare drafts against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.arguments import SEED_MAX, integer, number
from lucebox.errors import InvalidArgumentError

# Beyond these, dividing a logit by the temperature or the penalty overflows float32 to inf, and no
# token could be chosen; refusing them names the setting instead of blaming the weights.
MIN_TEMPERATURE = 1e-5
PENALTY_RANGE = (1e-3, 1e3)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        # Checked and normalized (a numpy float becomes a float) once, here, for every caller.
        checked = {
            "temperature": number("temperature", self.temperature, 0),  # 0 is greedy
            "top_k": integer("top_k", self.top_k, 0),  # 0 turns it off
            "top_p": number("top_p", self.top_p, 0, 1, low_open=True),
            "min_p": number("min_p", self.min_p, 0, 1),
            "repetition_penalty": number("repetition_penalty", self.repetition_penalty, *PENALTY_RANGE),
            "seed": integer("seed", self.seed, 0, SEED_MAX, optional=True),  # None: from the OS
        }
        if 0 < checked["temperature"] < MIN_TEMPERATURE:
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                                       f"{self.temperature}: below that, logits divided by it overflow float32")
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: the documented way to normalize in __post_init__

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive, multiply negative logits of tokens already in the sequence."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor) -> torch.Tensor:
    """Probabilities (V,) float32 the next token is drawn from; `seen` (V,) bool marks tokens so far."""
    logits = penalize_repetition(logits.to(torch.float32), seen, params.repetition_penalty)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).to(torch.float32)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from `probs` without a host sync: argmax of p / Exp(1) (the exponential race)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax()


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (k+1,), on the device; -1 everywhere when any logit is not finite (the
    host sees that when it reads the tokens, which it must do anyway: no extra sync)."""
    return torch.where(torch.isfinite(logits).all(), logits.float().argmax(-1), -1)
