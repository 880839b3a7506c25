"""Rotary position embeddings (default, linear, llama3, YaRN; partial rotary), torch reference.

Frequencies and angles are computed in float32 and the tables cast to the model dtype, as the
reference implementations do, so float64 runs match them to rounding.
"""

from __future__ import annotations

import math

import torch
from lucebox.kernels import moe
from lucebox.kernels.norm import normed_on_cpu

from lucebox.config import RopeSpec


def inverse_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, attention scaling applied to cos and sin)."""
    inv_freq, scaling = _by_kind(spec)
    if spec.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(spec.freq_factors, dtype=torch.float32)
    return inv_freq, scaling


def _by_kind(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base = spec.rotary_dim, spec.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if spec.kind == "default":
        return inv_freq, 1.0
    if spec.kind == "linear":
        return inv_freq / spec.factor, 1.0
    if spec.kind == "llama3":
        return _llama3(inv_freq, spec), 1.0
    if spec.kind == "yarn":
        return _yarn(spec)
    raise ValueError(f"unknown rope kind {spec.kind}")


def _llama3(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    old_len = spec.original_max_position
    low_wavelen = old_len / spec.low_freq_factor
    high_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    dim, base, factor = spec.rotary_dim, spec.theta, spec.factor
    attention = spec.attention_factor
    if attention is None:
        if spec.mscale and spec.mscale_all_dim:
            attention = _yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class RotaryTables:
    """One float32 frequency vector per distinct RopeSpec, kept on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._freqs: dict[RopeSpec, tuple[torch.Tensor, float]] = {}

    def frequencies(self, spec: RopeSpec) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim/2] float32 on the device, attention scaling)."""
        if spec not in self._freqs:
            inv_freq, scaling = inverse_frequencies(spec)
            self._freqs[spec] = (inv_freq.to(self.device), scaling)
        return self._freqs[spec]


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """The tables `apply_rope` takes, (T, 1, rotary_dim) each (broadcast over heads), computed in
    float32 and cast to dtype: cos, and sin with its first half negated (the sign rotate-half puts
    on the features it moves down, carried by the table so a rotation is a roll)."""
    angles = positions.to(torch.float32)[:, None, None] * inv_freq  # (T, 1, rotary_dim/2)
    cos, sin = (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


# (id of the frequencies, scaling, dtype, inference mode) -> (frequencies, positions copied, (cos, sin)): the CPU's
# tables of the last positions each rotary spec was asked for. One entry per spec, since a model may
# alternate two (sliding and full layers with their own theta): one shared entry would be recomputed
# at every change of spec. The entry holds its frequency tensor, so the id is not reused meanwhile.
_step_tables: dict = {}
MAX_ROTARY_SPECS = 8  # more specs than this at once (many models in one process): start over


def step_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """`cos_sin`, computed once per step and rotary spec on the CPU: every layer of a forward
    rotates at the same positions, and there the ~9 small ops of the tables cost ~5% of a small
    model's decode step. Tables are reused only for equal positions (compared by value: one op) and
    the same frequency tensor, so they are the very values `cos_sin` gives. On a GPU (launches
    queued, graphs captured) every call computes its own."""
    if not moe.reads_wait_for_nothing(positions.device):  # compared on the host: never in a graph's body
        return cos_sin(positions, inv_freq, scaling, dtype)
    # tables made under inference mode cannot be saved for a backward pass: kept apart
    key = (id(inv_freq), scaling, dtype, torch.is_inference_mode_enabled())
    entry = _step_tables.get(key)  # one read: another thread may replace the entry meanwhile
    if entry is not None:
        freq, last_positions, tables = entry
        if freq is inv_freq and last_positions.shape == positions.shape and torch.equal(last_positions, positions):
            return tables
    tables = cos_sin(positions, inv_freq, scaling, dtype)
    if len(_step_tables) >= MAX_ROTARY_SPECS:
        _step_tables.clear()
    _step_tables[key] = (inv_freq, positions.clone(), tables)
    return tables


def rotate(xs: tuple[torch.Tensor, ...], positions: torch.Tensor, inv_freq: torch.Tensor,
           scaling: float) -> tuple[torch.Tensor, ...]:
    """Each x (T, heads, D) of xs (a layer's q and k) with its first 2 * len(inv_freq) features
    rotated by position; the angles are computed once for all of them."""
    cos, sin = step_cos_sin(positions, inv_freq, scaling, xs[0].dtype)
    if len(xs) == 1:
        return (apply_rope(xs[0], cos, sin),)
    # All heads side by side, rotated at once: the same arithmetic per element in a third of the
    # ops, which is most of a small model's decode step on the CPU.
    heads = [x.shape[1] for x in xs]
    rotated = apply_rope(torch.cat(xs, dim=1), cos, sin).split_with_sizes(heads, 1)
    return tuple(x.contiguous() for x in rotated)


def norm_rotate_on_cpu(q: torch.Tensor, key: torch.Tensor, head_weights: torch.Tensor, eps: float,
                       positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
    """q (T, Hq, D) and k (T, KV, D) RMS-normed over D with `head_weights` (Hq + KV, D) (each head's
    norm weight: q's, then k's) and rotated: the values `norm.rms_norm` on each and `rotate` give,
    bit for bit (float32 on the CPU), in half the norms' dispatches: the heads side by side, one
    norm, one multiply by the weights, one rotation."""
    both = torch.cat((q, key), dim=1)
    both = normed_on_cpu(both, head_weights, eps)
    (both,) = rotate((both,), positions, inv_freq, scaling)
    return tuple(x.contiguous() for x in both.split_with_sizes([q.shape[1], key.shape[1]], 1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of x (T, heads, D) in the rotate-half layout, with the
    tables of `cos_sin`: x * cos + (-x2, x1) * sin, where (x2, x1) is x rolled by half the rotary
    width and the table carries the minus (the same products, bit for bit, in 2 ops fewer)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:  # every feature rotated: no pass-through part to append
        return x * cos + x.roll(rot // 2, -1) * signed_sin
    x_rot = x[..., :rot]
    return torch.cat((x_rot * cos + x_rot.roll(rot // 2, -1) * signed_sin, x[..., rot:]), dim=-1)
