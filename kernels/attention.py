"""Attention of a block of query rows over cached keys, torch reference.

Keys carry their absolute positions, so the same code serves rings, pages and host chunks: a
query at position p sees a key at position k when 0 <= k <= p, and p - k < window on sliding
layers (slots holding no key have position -1). Keys may arrive in several blocks (resident pool,
host chunks streamed through); each block gives a partial result and its log-sum-exp, and
`merge_partials` combines them exactly (the online-softmax rule), so no (T, context) score matrix
is ever built for more than one block at a time.

Tree verification (`tree_bits`): a step's rows are the nodes of a draft tree, row 0 its root at the
step's first position c = q_positions[0]; row i was written at scratch position c + i while its
query carries its true position c + depth_i. A key at position >= c is then one of the step's own
rows, visible to query t iff bit (position - c) of tree_bits[t] is set (an ancestor or itself;
the caller clears the bits of ancestors outside the window, `models.tree_mask`); keys before c
follow the rules above at the query's true position.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from lucebox.kernels import moe
from lucebox.kernels.gate import softplus_gate
from lucebox.kernels.kv_int8 import dequantize_rows


def attention_partial(
    q: torch.Tensor,  # (T, Hq, D), RoPE applied
    k: torch.Tensor,  # (KV, S, D)
    v: torch.Tensor,  # (KV, S, D)
    q_positions: torch.Tensor,  # (T,)
    k_positions: torch.Tensor,  # (S,), -1 for empty slots
    scale: float,
    window: int | None = None,
    pinned: torch.Tensor | None = None,  # (S,) bool: if given, only pinned or `recent` keys are visible
    recent: int = 0,
    all_visible: bool = False,  # the caller knows no key needs masking (older, valid, in window)
    k_scale: torch.Tensor | None = None,  # (KV, S) float32: k and v are int8 rows (`kernels.kv_int8`)
    v_scale: torch.Tensor | None = None,  # (KV, S)
    tree_bits: torch.Tensor | None = None,  # (T,) int64: each row's ancestor-or-self rows, as bits
    gate: torch.Tensor | None = None,  # (T, Hq) or (T, Hq*D): softplus output gate logits (`kernels.gate`)
    ring: bool = False,  # k/v are a ring whose slot is position % S: a hint for how to split the work
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T, Hq, D) normalized over this block, lse (T, Hq) float32/64; -inf where nothing is visible).
    With `gate`, out is gated (a step attending over one block only: the lse is the ungated one's)."""
    if k_scale is not None:
        k, v = dequantize_rows(k, k_scale, q.dtype), dequantize_rows(v, v_scale, q.dtype)
    T, Hq, D = q.shape
    kv_heads = k.shape[0]
    group = Hq // kv_heads
    visible = prepared = None
    fused = q.device.type == "cpu" and q.dtype == torch.float32 and k.shape[1] and not q.requires_grad
    # Shared masks compare positions on the host: never in a graph's body (`moe.reads_wait_for_nothing`).
    if not all_visible and fused and pinned is None and tree_bits is None and moe.reads_wait_for_nothing(q.device):
        visible, prepared = _shared_cpu_mask(q_positions, k_positions, window, group)
    elif not all_visible:
        visible = _visible(q_positions, k_positions, window, pinned, recent, tree_bits)
    # Query heads of one KV group side by side: (KV, group*T, D) against (KV, S, D). One row needs
    # no permutes (the same elements in the same order: a decode step on the CPU saves 6 dispatches a layer).
    one = T == 1
    qg = q.view(kv_heads, group, D) if one else q.view(T, kv_heads, group, D).permute(1, 2, 0, 3).reshape(
        kv_heads, group * T, D)
    if fused:
        out, lse = _fused_on_cpu(qg, k, v, visible, scale, group, prepared)
    else:
        out, lse = _unfused(qg, k, v, visible, scale, group)
    out = out.reshape(1, Hq, D) if one else out.view(kv_heads, group, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)
    if gate is not None:
        out = softplus_gate(out, gate)
    return out, (lse.reshape(1, Hq) if one else lse.view(kv_heads, group, T).permute(2, 0, 1).reshape(T, Hq))


def _visible(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None, pinned: torch.Tensor | None,
             recent: int, tree_bits: torch.Tensor | None) -> torch.Tensor:
    """(T, S) bool: which keys each query sees (the rules in the module's docstring)."""
    visible = (k_positions[None, :] <= q_positions[:, None]) & (k_positions[None, :] >= 0)
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    if pinned is not None:
        visible &= pinned[None, :] | (k_positions[None, :] > q_positions[:, None] - recent)
    if tree_bits is not None:
        visible = _tree_visible(visible, tree_bits, q_positions, k_positions)
    return visible


# (window, rows, keys, query heads per KV head, inference mode, first row's position) -> (key
# positions, query positions, visible, (additive mask in the fused op's layout, rows seeing a
# key)), each of the last two None where every key / every row passes: the CPU's masks of the
# last step, by layer kind (and sequence, in a batched step: `engine.batcher`). Every
# sliding layer of a step holds the same positions in a ring of its own (and every full layer in
# its pages), so one mask serves them all: ~8 small ops a layer become 2 comparisons (by value, so
# a mask is only ever reused for the very positions it was made from).
_cpu_masks: dict = {}
MAX_CPU_MASKS = 32


def _shared_cpu_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None, group: int):
    """`_visible` without pinned keys or a tree, and what `_fused_on_cpu` makes of it for `group`
    query heads per KV head, reused across the layers of a step on the CPU."""
    # By the step's first position too: the sequences of a batched step (`engine.batcher`) each keep theirs.
    key = (window, q_positions.shape[0], k_positions.shape[0], group, torch.is_inference_mode_enabled(),
           int(q_positions[0]))
    entry = _cpu_masks.get(key)  # one read: another thread may replace the entry meanwhile
    if entry is not None and torch.equal(entry[0], k_positions) and torch.equal(entry[1], q_positions):
        return entry[2], entry[3]
    visible = _visible(q_positions, k_positions, window, None, 0, None)
    # Read on the host once per step (a CPU read waits for nothing): a mask every key passes is
    # left out of the fused op, and so is the fix-up of rows that see no key when none is blind
    # (a decode step's full layers, and every row that sees itself).
    seeing = visible.any(-1)
    mask = None if bool(visible.all()) else _fused_mask(visible, group)
    prepared = (mask, None if bool(seeing.all()) else seeing)
    if len(_cpu_masks) >= MAX_CPU_MASKS:
        _cpu_masks.clear()
    _cpu_masks[key] = (k_positions.clone(), q_positions.clone(), visible, prepared)
    return visible, prepared


def _unfused(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float,
             group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (KV, group*T, D), lse (KV, group, T)) in torch ops: the reference every backend matches."""
    kv_heads, T = qg.shape[0], qg.shape[1] // group
    scores = torch.matmul(qg, k.transpose(1, 2)) * scale  # (KV, group*T, S)
    compute = torch.float32 if qg.dtype in (torch.float16, torch.bfloat16) else qg.dtype
    scores = scores.view(kv_heads, group, T, -1).to(compute)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (KV, group, T)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(compute).min)[..., None])  # rows with no key: all 0
    return torch.matmul(probs.to(v.dtype).view(kv_heads, group * T, -1), v), lse  # (KV, group*T, D)


# torch's CPU flash attention, the one variant that returns the log-sum-exp a partial result needs.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")  # noqa: B009 (private by name only)


def _fused_on_cpu(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float,
                  group: int, prepared: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_unfused` for float32 on the CPU in torch's fused attention op (one dispatch for the ~12 ops
    a small model's decode spends there, each a few microseconds; the same softmax in another
    summation order: within float32 rounding, `tests/test_cpu_decode_ops.py`). The op gives rows
    with no visible key an lse of 0: set to -inf, as the reference gives, so merging ignores them."""
    kv_heads, T = qg.shape[0], qg.shape[1] // group
    mask = seeing = None
    if visible is not None:
        mask, seeing = prepared or (_fused_mask(visible, group), visible.any(-1))
    out, lse = _CPU_FLASH(qg[None], k[None], v[None], attn_mask=mask, scale=scale)
    lse = lse.view(kv_heads, group, T)
    if seeing is not None:
        lse = torch.where(seeing, lse, float("-inf"))
    return out[0], lse


def _fused_mask(visible: torch.Tensor, group: int) -> torch.Tensor:
    """The additive float32 mask of `_fused_on_cpu`'s op: (T, S), or (group*T, S) for the group's
    query rows side by side when T > 1 (one row broadcasts over them)."""
    mask = torch.where(visible, 0.0, float("-inf"))  # float32: the scalars' default
    return mask.repeat(group, 1) if visible.shape[0] > 1 else mask


def _tree_visible(visible: torch.Tensor, bits: torch.Tensor, q_positions: torch.Tensor,
                  k_positions: torch.Tensor) -> torch.Tensor:
    """`visible` (T, S) with the step's own keys (positions >= q_positions[0]) decided by the bits."""
    offset = k_positions[None, :] - q_positions[:1, None]  # (1, S): the key's row in the step
    own = offset >= 0
    # Offsets past 62 hold no row of a step of at most DECODE_ROWS rows; clamped, their bit is 0.
    bit = (bits[:, None] >> offset.clamp(0, 62)) & 1
    return torch.where(own, (bit == 1) & (offset <= 62), visible)


def merge_partials(parts: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine per-block (out, lse) into attention over the union of the blocks, consuming them one
    at a time: a running log-sum-exp merge into one float32/64 accumulator, so the extra memory is
    one block's partial beside it however many blocks a long prefill streams (stacking them all
    would hold every block's). One block is returned as it is."""
    parts = iter(parts)
    out, total = next(parts)  # (T, Hq, D), (T, Hq)
    following = next(parts, None)
    if following is None:
        return out
    dtype = out.dtype
    out = out.to(total.dtype, copy=True)  # written in place from here on
    while following is not None:
        block_out, block_lse = following
        merged = torch.logaddexp(total, block_lse)
        # A row no block has seen yet stays at zeros and -inf: weights of nothing are 0, not NaN.
        out.mul_(_weight(total, merged)[..., None]).addcmul_(block_out, _weight(block_lse, merged)[..., None])
        total = merged
        # Nothing keeps this block's partial while the next one is computed.
        del following, block_out, block_lse
        following = next(parts, None)
    return out.to(dtype)


def _weight(lse: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """exp(lse - merged): a block's share of the merged softmax, 0 where neither saw a key."""
    return torch.exp(lse - merged).nan_to_num_(0.0)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T, Hq, D), lse (T, Hq)) of B partial results stacked as (B, T, Hq, D) and (B, T, Hq),
    accumulated in the lse's float32/64 whatever the activations' dtype."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total[None]).nan_to_num(0.0)  # blocks with nothing visible weigh 0
    return (weights[..., None] * outs.to(weights.dtype)).sum(0), total


def attention_over_blocks(
    q: torch.Tensor, q_positions: torch.Tensor, blocks: Iterable, scale: float, window: int | None = None,
    partial=attention_partial, tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention (T, Hq, D) over every `KVBlock` a cache hands out for this step; `partial` is
    the per-block kernel (this reference or the Triton one)."""
    tree = {} if tree_bits is None else {"tree_bits": tree_bits}  # kernels without trees keep their signature
    return merge_partials(
        partial(q, b.k, b.v, q_positions, b.positions, scale, window, b.pinned, b.recent, b.all_visible,
                k_scale=b.k_scale, v_scale=b.v_scale, **tree)
        for b in blocks
    )
