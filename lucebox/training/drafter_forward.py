"""A DFlash drafter's forward over many blocks of a batch at once, differentiably: what `distill`
trains. It is `DFlashDrafter.context_rows` + `draft` (the engine's inference code) with the
ring and the per-block passes replaced by one masked attention:

- the context rows are every position of each sequence, projected from the target's features
  by `project_features`, as `context_rows` projects them;
- a block anchored at position a is [token a, MASK x (block_size - 1)] at positions a.., and sees
  the context rows before a (what the ring holds when the engine drafts after token a - 1 is
  committed) and its own block (all of it, or causally), within the layer's window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.models.decoder import Decoder
from lucebox.models.dflash import DFlashDrafter
from lucebox.training.forward import batch_attention


def block_mask(anchors: torch.Tensor, T: int, block: int, window: int | None, causal: bool) -> torch.Tensor:
    """(B, M*block, T + M*block) bool for anchors (B, M): which context and block keys each block row sees."""
    B, M = anchors.shape
    device = anchors.device
    q_pos = (anchors[:, :, None] + torch.arange(block, device=device)).reshape(B, M * block)  # (B, R)
    ctx_pos = torch.arange(T, device=device)
    first = anchors.repeat_interleave(block, dim=1)  # (B, R): each row's block anchor
    sees_ctx = ctx_pos[None, None, :] < first[:, :, None]
    if window is not None:
        sees_ctx &= ctx_pos[None, None, :] > q_pos[:, :, None] - window
    which = torch.arange(M, device=device).repeat_interleave(block)  # (R,) each row's block
    j = torch.arange(block, device=device).repeat(M)  # (R,) each row's place in its block
    sees_block = which[:, None] == which[None, :]
    if causal or window is not None:  # sliding drafter layers are causal inside the block too
        sees_block = sees_block & (j[None, :] <= j[:, None])
    return torch.cat([sees_ctx, sees_block[None].expand(B, -1, -1)], dim=2)


def draft_hidden(drafter: DFlashDrafter, target: Decoder, features: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """features (B, T, n*H) and tokens (B, T) of whole sequences, anchors (B, M) ->
    the drafter's hidden states of every block row (B, M, block, H), after its final norm."""
    cfg = drafter.cfg
    B, T = tokens.shape
    M, bs = anchors.shape[1], cfg.block_size
    device = tokens.device
    ctx = drafter.project_features(features.reshape(B * T, -1))  # (B*T, H)
    ctx_pos = torch.arange(T, device=device).repeat(B)
    ids = torch.full((B, M, bs), cfg.mask_token_id, device=device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.reshape(-1), target.w["embed"]).to(drafter.dtype) * cfg.embedding_scale  # (B*M*bs, H)
    q_pos = (anchors[:, :, None] + torch.arange(bs, device=device)).reshape(-1)
    R = M * bs

    def attend(layer: int, q, k, v):  # every sequence's context, then the blocks, under the block mask
        kc, vc = drafter.context_kv(layer, ctx, ctx_pos)
        keys = torch.cat([kc.view(B, T, *kc.shape[1:]), k.view(B, R, *k.shape[1:])], dim=1)
        values = torch.cat([vc.view(B, T, *vc.shape[1:]), v.view(B, R, *v.shape[1:])], dim=1)
        mask = block_mask(anchors, T, bs, cfg.windows[layer], cfg.causal)
        out = batch_attention(q.view(B, R, *q.shape[1:]), keys, values, mask, drafter.scale)
        return out.reshape(B * R, *q.shape[1:])

    for layer in range(cfg.num_layers):
        x = drafter.run_layer(layer, x, q_pos, attend)
    return drafter.norm(x, "norm").view(B, M, bs, -1)
