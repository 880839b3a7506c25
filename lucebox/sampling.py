"""Turning target logits into the next token: the logit bias, repetition penalty, presence and frequency
penalties, temperature, top-k, top-p, min-p (in that order, as vLLM applies them: the bias on the raw
logits, then the penalties as transformers' generate does), then a seeded draw.

`distribution` returns the final processed probabilities, which is also what speculative
verification must compare drafts against.

`RaceNoise` draws a token by the exponential race against noise keyed by (seed, position, token)
rather than by a generator's stream: the token at position n is argmax p_n(x) / E(seed, n, x).
Each position's noise is independent of every other's, so a sequence drawn this way follows the
target's distribution exactly; and since a position's token depends only on its prefix and its own
noise, a drafter that races its own distribution against the same noise proposes, for a
deterministic draft, the token the target will most likely pick. Speculation verified this way
commits exactly the tokens plain decoding with the same seed commits, whatever was drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lucebox.arguments import SEED_MAX, integer, number, token_biases
from lucebox.errors import InvalidArgumentError

# Beyond these, dividing a logit by the temperature or the penalty overflows float32 to inf, and no
# token could be chosen; refusing them names the setting instead of blaming the weights.
MIN_TEMPERATURE = 1e-5
PENALTY_RANGE = (1e-3, 1e3)
COUNT_PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence_penalty and frequency_penalty


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted from it once per time the token was generated
    # ((token id, bias), ...) by id, added to the raw logits (OpenAI's logit_bias); a {id: bias} mapping is
    # normalized to it. Ids are checked against the vocabulary by `LLM.stream`, which knows it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    _bias_rows: dict = field(default_factory=dict, compare=False, repr=False)  # (V, device) -> (V,) float32

    def __post_init__(self) -> None:
        # Checked and normalized (a numpy float becomes a float) once, here, for every caller.
        checked = {
            "temperature": number("temperature", self.temperature, 0),  # 0 is greedy
            "top_k": integer("top_k", self.top_k, 0),  # 0 turns it off
            "top_p": number("top_p", self.top_p, 0, 1, low_open=True),
            "min_p": number("min_p", self.min_p, 0, 1),
            "repetition_penalty": number("repetition_penalty", self.repetition_penalty, *PENALTY_RANGE),
            "seed": integer("seed", self.seed, 0, SEED_MAX, optional=True),  # None: from the OS
            "presence_penalty": number("presence_penalty", self.presence_penalty, *COUNT_PENALTY_RANGE),
            "frequency_penalty": number("frequency_penalty", self.frequency_penalty, *COUNT_PENALTY_RANGE),
            "logit_bias": token_biases("logit_bias", self.logit_bias),
        }
        if 0 < checked["temperature"] < MIN_TEMPERATURE:
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got "
                                       f"{self.temperature}: below that, logits divided by it overflow float32")
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: the documented way to normalize in __post_init__

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_generated(self) -> bool:
        """Whether the logits depend on how often each token was generated (presence/frequency)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def reads_history(self) -> bool:
        """Whether a penalty reads the tokens so far (repetition, presence, frequency)."""
        return self.repetition_penalty != 1.0 or self.counts_generated

    @property
    def penalized(self) -> bool:
        """Whether a penalty or the logit bias changes the logits (else a step's own argmax is the greedy choice)."""
        return self.reads_history or bool(self.logit_bias)

    def bias_row(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) float32: the logit bias as one row to add, built once per device (a request's steps share it)."""
        key = (vocab, str(device))
        if key not in self._bias_rows:
            row = torch.zeros(vocab, dtype=torch.float32)
            for token, bias in self.logit_bias:
                if token < vocab:  # ids past a drafter's logits (none, once `LLM.stream` checked them) add nothing
                    row[token] = bias
            self._bias_rows[key] = row.to(device)
        return self._bias_rows[key]


def add_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) with `params.logit_bias` added to each row (the same logits when there is none)."""
    if not params.logit_bias:
        return logits
    return logits + params.bias_row(logits.shape[-1], logits.device).to(logits.dtype)


def penalize(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
             counts: torch.Tensor | None) -> torch.Tensor:
    """Every change `params` makes to logits (..., V) float32: the logit bias, then the repetition penalty
    over `seen` (..., V) bool (prompt and generated tokens), then OpenAI's presence and frequency
    penalties over `counts` (..., V) float32, how often each token was generated in this completion (the
    prompt not counted): logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty."""
    logits = penalize_repetition(add_bias(logits, params), seen, params.repetition_penalty)
    if counts is None or not params.counts_generated:
        return logits
    return logits - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive, multiply negative logits of tokens already in the sequence."""
    if penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def distribution(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities (..., V) float32 the next token is drawn from, for logits (..., V) (each row on
    its own); `seen` (V,) or (..., V) bool marks tokens so far, `counts` (V,) or (..., V) float32
    how often each was generated (`penalize`)."""
    logits = penalize(logits.to(torch.float32), params, seen, counts)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from `probs` without a host sync: argmax of p / Exp(1) (the exponential race)."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax()


_MASK32 = 0xFFFFFFFF
TOKEN_BITS = 20  # token ids the coupled sampler's keys hold: vocabularies up to 2^20
ROW_VALUES_KEPT = 1 << 21  # noise values (float64, 16 MiB) a request keeps on the CPU, reused by later races
MIN_ROWS_KEPT = 32  # at least a drafted block's and its verification's positions


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (bijective; good avalanche) of int64 values in [0, 2^32). Products
    may wrap past 2^63: int64 arithmetic wraps, and only the low 32 bits are kept."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class RaceNoise:
    """Exponential noise E(seed, position, token), a pure function of its key (no generator
    state), for `RaceNoise.choose`: a sample of each row's distribution at its position.

    On the CPU each position's row is hashed once and kept (the newest `_rows_kept` rows): a
    speculative round's drafter races the very positions its verification then races again, and
    hashing a vocabulary's keys costs a CPU nearly what a small model's decode step does. Values
    are the same either way; GPUs hash every time (cheap there, and no position is read back)."""

    seed: int
    _rows: dict = field(default_factory=dict, compare=False, repr=False)  # (position, vocab) -> (V,) float64

    def exponentials(self, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        """(R, V) float64 Exp(1) variates for rows at `positions` (R,) int64 (R = 1 broadcasts
        against any number of rows at one position)."""
        if vocab > 1 << TOKEN_BITS:
            raise InvalidArgumentError(f"a vocabulary of {vocab} ids is more than the coupled sampler keys "
                                       f"(2^{TOKEN_BITS}); use verify='tokenwise'")
        if positions.device.type != "cpu":
            return self._hashed(positions, vocab)
        wanted = positions.tolist()
        missing = sorted({p for p in wanted if (p, vocab) not in self._rows})
        if missing:
            for position, row in zip(missing, self._hashed(torch.tensor(missing), vocab), strict=True):
                self._rows[(position, vocab)] = row
        rows = torch.stack([self._rows[(p, vocab)] for p in wanted])
        kept = max(MIN_ROWS_KEPT, ROW_VALUES_KEPT // vocab)
        while len(self._rows) > kept:  # positions grow through a request: the oldest go first
            del self._rows[next(iter(self._rows))]
        return rows

    def _hashed(self, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        # Each (position, token) is one distinct 64-bit key, hashed with the seed in two 32-bit halves.
        key = (positions.long()[:, None] << TOKEN_BITS) | torch.arange(vocab, device=positions.device)[None, :]
        lo, hi = key & _MASK32, key >> 32
        first = _mix32(lo ^ (self.seed & _MASK32)) ^ ((self.seed >> 32) & _MASK32)
        bits = _mix32(_mix32((first + hi) & _MASK32) ^ 0x9E3779B9)
        # 32 random bits: uniform in (0, 1), never 0 or 1, so -log is finite and positive. Coarser
        # than float64 only below a probability ratio of 2^-32, far under float32 logits' precision.
        return -torch.log(bits.double().add_(0.5).mul_(2.0 ** -32))

    def scores(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """log p - log E (R, V) float64: each row's argmax is its race's winner, and their softmax
        weighs each token by how close it came (a drafter's confidence; a tree's ranking)."""
        return race_scores(probs, self.exponentials(positions, probs.shape[-1]).log())

    def choose(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each row's race winner (R,), on the device; -1 when any probability is not finite."""
        winners = (probs.double() / self.exponentials(positions, probs.shape[-1])).argmax(-1)
        return torch.where(torch.isfinite(probs).all(), winners, -1)


def race_scores(probs: torch.Tensor, log_noise: torch.Tensor) -> torch.Tensor:
    """log p - log E: `RaceNoise.scores` for noise whose log was taken already (one hash for a block)."""
    return probs.double().log() - log_noise


def greedy_choices(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (k+1,), on the device; -1 in a row with a logit that is not finite (the
    host sees that when it reads the tokens, which it must do anyway: no extra sync). A verify
    step reaches a -1 before any token after it is kept: the rows before it are what plain
    decoding would have computed. The Triton version (`kernels/greedy_triton.py`) is one launch."""
    return torch.where(torch.isfinite(logits).all(-1), logits.float().argmax(-1), -1)
