"""The engine's own decoder run over a batch of whole sequences: differentiably, the forward that
trains a target and that captures target features for a drafter (`forward_batch`); without
gradients, batched greedy generation over a growing `BatchCache` (distillation data).

Both are the decoder's own layer loop (`Decoder.run`) on the (B*T, H) rows of the batch; only how
attention reaches its keys differs (`BatchContext`): one masked scaled-dot-product over each
sequence (causal, and windowed on sliding layers), which is what the engine's caches compute step
by step. A recurrent (Gated DeltaNet) layer gets `SideBySideState`: every sequence starts from a
zero state of its own and runs the chunked delta rule over its whole rows (a prefill's path), the
B states side by side so that none folds in another's rows. So a model trained here runs
unchanged in the engine, and the features a drafter learns from are the ones the engine hands it
at inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.config import LinearAttentionSpec
from lucebox.models.decoder import Decoder


def visibility(T: int, window: int | None, device: torch.device, start: int = 0) -> torch.Tensor:
    """(T, start + T) bool: query row r (at position start + r) sees the key at position k when
    k <= start + r (and start + r - k < window)."""
    q = torch.arange(start, start + T, device=device)
    k = torch.arange(start + T, device=device)
    seen = k[None, :] <= q[:, None]
    if window is not None:
        seen &= k[None, :] > q[:, None] - window
    return seen


def batch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """q (B, T, Hq, D), k and v (B, S, KV, D), mask (T, S) or (B, T, S) bool -> (B, T, Hq, D)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    mask = mask if mask.dim() == 2 else mask[:, None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


class SideBySideState:
    """One recurrent layer's state for B sequences, each its own, side by side (the layout the
    Gated DeltaNet mixer reads as B sequences): conv (K - 1, B*C), recurrent (B*Hv, Dk, Dv), zero
    at the start. `update` replaces them (no in-place write: gradients flow through a training
    forward); a `BatchCache` keeps them for the next forward of a batched generation."""

    every_row = False  # a forward over whole sequences (or their next rows) keeps only the last state

    def __init__(self, spec: LinearAttentionSpec, B: int, dtype: torch.dtype, device: torch.device):
        K, C = spec.conv_kernel, spec.conv_channels
        self.conv = torch.zeros(K - 1, B * C, dtype=dtype, device=device)
        # float32 at least, as the engine's state cache keeps it (`caches.recurrent.RecurrentState`)
        self.recurrent = torch.zeros(B * spec.value_heads, spec.key_dim, spec.value_dim,
                                     dtype=torch.promote_types(dtype, torch.float32), device=device)

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.recurrent

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent


class BatchCache:
    """K/V of every attention layer, and the state of every recurrent one, for a batch of equally
    long sequences, for batched greedy generation."""

    def __init__(self, layers: int):
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.states: dict[int, SideBySideState] = {}  # by recurrent layer, made by the first forward
        self.length = 0

    def extend(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, t, KV, D) rows to layer i; returns all of its keys and values so far."""
        self.k[i] = key if self.k[i] is None else torch.cat([self.k[i], key], dim=1)
        self.v[i] = value if self.v[i] is None else torch.cat([self.v[i], value], dim=1)
        return self.k[i], self.v[i]


class BatchContext:
    """A forward over B sequences of T rows each, at positions start .. start + T - 1 (start: the
    rows `cache` already holds, else 0), as (B*T, ...) rows: each layer attends by one masked
    scaled-dot-product per sequence over its earlier rows, causal and windowed on sliding
    layers; each recurrent layer continues one state per sequence (`SideBySideState`). With a
    `BatchCache` the rows are appended to it first and attend over all it holds, and the states
    it keeps go on (batched generation); without one, over this forward's rows alone, from zero
    states (training)."""

    def __init__(self, decoder: Decoder, B: int, T: int, cache: BatchCache | None = None):
        self.B, self.T, self.device, self.scale, self.cache = B, T, decoder.device, decoder.scale, cache
        self.spec, self.dtype = decoder.cfg.linear_attention, decoder.dtype
        self.start = cache.length if cache is not None else 0
        self.positions = torch.arange(self.start, self.start + T, device=self.device).repeat(B)  # (B*T,)
        self.masks: dict[int | None, torch.Tensor] = {}  # by window
        self.states = cache.states if cache is not None else {}

    def recurrent_state(self, layer: int) -> SideBySideState:
        if layer not in self.states:
            if self.start:  # a cache that holds rows holds every recurrent layer's state
                raise RuntimeError(f"recurrent layer {layer} has no state after {self.start} rows")
            self.states[layer] = SideBySideState(self.spec, self.B, self.dtype, self.device)
        return self.states[layer]

    def row_table(self, layer: int) -> None:
        return None  # `attend` keeps the rows

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        B, T = self.B, self.T
        key, value = key.view(B, T, *key.shape[1:]), value.view(B, T, *value.shape[1:])
        if self.cache is not None:
            key, value = self.cache.extend(layer, key, value)
        if window not in self.masks:
            self.masks[window] = visibility(T, window, self.device, self.start)
        out = batch_attention(q.view(B, T, *q.shape[1:]), key, value, self.masks[window], self.scale)
        return out.reshape(B * T, *q.shape[1:])


def forward_batch(decoder: Decoder, token_ids: torch.Tensor, layers: tuple[int, ...] = ()):
    """token_ids (B, T) -> (hidden after the final norm (B, T, H), the outputs of decoder `layers`
    side by side (B, T, len(layers) * H) or None): `Decoder.run` for a batch of whole sequences."""
    B, T = token_ids.shape
    context = BatchContext(decoder, B, T)
    hidden, features = decoder.run(token_ids.reshape(-1), context, layers)
    return hidden.view(B, T, -1), None if features is None else features.view(B, T, -1)


@torch.no_grad()
def forward_cached(decoder: Decoder, token_ids: torch.Tensor, cache: BatchCache) -> torch.Tensor:
    """token_ids (B, t) following the cache's rows -> hidden after the final norm (B, t, H)."""
    B, t = token_ids.shape
    hidden, _ = decoder.run(token_ids.reshape(-1), BatchContext(decoder, B, t, cache))
    cache.length += t
    return hidden.view(B, t, -1)


@torch.no_grad()
def greedy_continuations(decoder: Decoder, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts (B, P) -> (B, P + new_tokens): each prompt followed by the model's greedy continuation."""
    cache = BatchCache(len(decoder.cfg.layers))
    hidden = forward_cached(decoder, prompts, cache)
    out = [prompts]
    for n in range(new_tokens):
        out.append(decoder.logits(hidden[:, -1]).argmax(-1, keepdim=True))  # (B, 1)
        if n + 1 < new_tokens:
            hidden = forward_cached(decoder, out[-1], cache)
    return torch.cat(out, dim=1)
