"""`lucebox distill --heads mtp`: train an MTP head (`models/mtp.py`) for any supported target, the
built-in model included, and write it in the checkpoint's own layout (mtp.* tensors, named as
Qwen3-Next and Qwen3.5 checkpoints ship theirs) in a folder of its own, which `draft=` takes.

The data are `distill`'s: windows of text, each followed by the target's greedy continuation.
The head learns the target's distributions (soft labels) as it drafts at inference: at depth 1,
row t reads the token at t + 1 and the target's final state at t and is trained toward the
target's distribution at t + 1 (the token at t + 2); at depth d it reads the token the depth
before it predicted and that depth's output state (the chain a round drafts), teacher-forced with
the sequence's tokens, weighted down by `DEPTH_WEIGHTS`. A deeper row attends to the rows of its
own depth before it (one causal pass per depth), where at inference it attends to rows made from
the target's states: an approximation (the Speculators library's MTP training makes it too) that
costs the deeper drafts some acceptance, never exactness.

The head starts from the target's last full-attention layer (its attention and MLP copied, as
`mtp.source_layer` shapes it), `fc` passing the target's state through and learning the
embedding's share, and unit norms.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lucebox.models import mtp
from lucebox.models.decoder import OFFSET_NORMS, Decoder
from lucebox.models.sources import to_checkpoint
from lucebox.training.checkpointing import save_state
from lucebox.training.forward import BatchContext, forward_batch

DEPTH_WEIGHTS = (1.0, 0.5)  # the loss of each drafting depth: a later draft counts only if the first is kept


def initial_head(target: Decoder, seed: int) -> dict[str, torch.Tensor]:
    """The head's starting tensors, in the checkpoint's convention (norms without the model's offset)."""
    cfg = mtp.head_config(target.cfg)
    source, offset, H = mtp.source_layer(target.cfg), cfg.norm_offset, cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in mtp.head_shapes(cfg).items():
        own = name.replace("layers.0.", f"layers.{source}.", 1) if name.startswith("layers.0.") else None
        copied = target.w.get(own) if own is not None else None
        is_norm = len(shape) == 1 and (name.rsplit(".", 1)[-1] in OFFSET_NORMS or name.startswith("norm"))
        if isinstance(copied, torch.Tensor) and tuple(copied.shape) == shape:
            weights[name] = copied.detach().float().clone() - (offset if is_norm else 0.0)
        elif is_norm:
            weights[name] = torch.full(shape, 1.0 - offset)
        elif name.endswith("router_bias"):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=g) * 0.02
    weights["fc"] = torch.cat([torch.randn(H, H, generator=g) * 0.02, torch.eye(H)], dim=1)  # the state, passed on
    return weights


def head_of(target: Decoder, weights: dict[str, torch.Tensor]) -> mtp.MTPHead:
    """The head running on `weights` (its own copies of the dict: the leaves stay the optimizer's)."""
    return mtp.MTPHead(mtp.head_config(target.cfg), dict(weights), target)


def head_rows(head: mtp.MTPHead, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) and states (B, T, H) -> the head's output states (B, T, H), causal per sequence."""
    B, T = tokens.shape
    out = head.run(tokens.reshape(-1), states.reshape(B * T, -1), BatchContext(head.layer, B, T))
    return out.view(B, T, -1)


def mtp_loss(head: mtp.MTPHead, target: Decoder, tokens: torch.Tensor, hidden: torch.Tensor,
             labels: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """(loss, head-argmax == target-argmax rate per depth) for tokens (B, T), the target's final
    states (B, T, H) and its distributions (B, T, V) (`labels`: position t's predicts t + 1)."""
    states, total, agree = hidden[:, :-1], 0.0, []
    for depth, weight in enumerate(DEPTH_WEIGHTS):
        rows = tokens.shape[1] - 1 - depth  # row t reads the token at t + 1 + depth
        if rows < 1:
            break
        states = head_rows(head, tokens[:, 1 + depth : 1 + depth + rows], states[:, :rows])
        logq = torch.log_softmax(head.logits(states).float(), dim=-1)
        p = labels[:, 1 + depth : 1 + depth + rows]
        total = total + weight * -(p * logq).sum(-1).mean()
        agree.append((logq.argmax(-1) == p.argmax(-1)).float().mean().item())
    return total / sum(DEPTH_WEIGHTS[: len(agree)]), agree


@torch.no_grad()
def target_states(target: Decoder, sequences: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """The target's final states (N, T, H) of every sequence, computed once (the target is frozen)."""
    return torch.cat([forward_batch(target, sequences[i : i + batch])[0] for i in range(0, len(sequences), batch)])


def train_head(target: Decoder, sequences: torch.Tensor, s, state_path: Path, on_step=None) -> tuple[dict, list]:
    """Train from the initial head, or resume from `state_path`; (the head's tensors, log). `s`:
    `distill.DistillSettings` (steps, batch, lr, warmup, seed)."""
    from lucebox.training.distill import set_learning_rate, start_training

    torch.manual_seed(s.seed)
    weights = {n: w.requires_grad_() for n, w in initial_head(target, s.seed).items()}
    optimizer, g, start, log = start_training(weights, list(weights.values()), s, state_path)
    hidden = target_states(target, sequences)
    t0 = time.perf_counter()
    for step in range(start, s.steps):
        set_learning_rate(optimizer, step, s)
        rows = torch.randint(0, len(sequences), (s.batch,), generator=g)
        with torch.no_grad():
            labels = torch.softmax(target.logits(hidden[rows]).float(), dim=-1)
        loss, agree = mtp_loss(head_of(target, weights), target, sequences[rows], hidden[rows], labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(weights.values()), 1.0)
        optimizer.step()
        record = {"step": step + 1, "loss": round(loss.item(), 4), "agree_first": round(agree[0], 3),
                  "s_per_step": round((time.perf_counter() - t0) / (step + 1 - start), 3)}
        if step % 10 == 0 or step + 1 == s.steps:
            log.append({**record, "agree_by_depth": [round(a, 3) for a in agree]})
        if on_step is not None:
            on_step(step + 1, record)
        if (step + 1) % 100 == 0 or step + 1 == s.steps:
            save_state(state_path, step + 1, weights, optimizer, log, generator=g.get_state())
    return {n: w.detach() for n, w in weights.items()}, log


SPECULATORS_FOLDER = "speculators"  # OUT/speculators: the head in the Speculators library's "mtp" layout


def save_head(folder: Path, target_hf: dict, target: Decoder, weights: dict, target_path: str = "") -> None:
    """The head in `folder`: its tensors under their checkpoint names (mtp.*) and a config.json
    saying whose head it is (the target's own, declaring the head); and in `folder`/speculators the
    Speculators library's "mtp" layout of the same tensors. `draft=` takes either."""
    cfg = mtp.head_config(target.cfg)
    text = target_hf.get("text_config") if isinstance(target_hf.get("text_config"), dict) else target_hf
    verifier = {"name_or_path": str(target_path), "architectures": list(target_hf.get("architectures") or [])}
    for where, layout, config in (
            (folder, "checkpoint", {**target_hf, "mtp_num_hidden_layers": 1, "lucebox_mtp_head": True}),
            (folder / SPECULATORS_FOLDER, "speculators", mtp.speculators_config(text, verifier))):
        where.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, source in mtp.head_sources(cfg, layout).items():
            tensors.update(to_checkpoint(weights[name].detach().to(torch.bfloat16), source))
        save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})
        (where / "config.json").write_text(json.dumps(config, indent=2) + "\n")
