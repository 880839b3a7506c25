"""`lucebox distill`: train a DFlash block drafter for a target on text, reading the target's own
hidden states from lucebox's forward, and write it in the public DFlash format (z-lab's
`DFlashDraftModel`: config.json with `dflash_config`, safetensors).

The drafter learns the target's distributions (soft labels) at every block position. Its data
are windows of the given text, each followed by the target's own greedy continuation: what the
drafter meets at inference is the target's text, and on it the target's argmax is the next token,
so every block position is trained on the sequences verification will compare against.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lucebox import arguments
from lucebox.errors import InvalidArgumentError
from lucebox.models import dflash
from lucebox.models.decoder import Decoder
from lucebox.models.sources import to_checkpoint
from lucebox.training.checkpointing import load_state, save_state
from lucebox.training.drafter_forward import draft_hidden
from lucebox.training.drafter_start import HEADS, head_names, load_start
from lucebox.training.dspark_loss import confidence_loss
from lucebox.training.forward import forward_batch, greedy_continuations


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    layers: int = 2
    block_size: int = 8
    attention_heads: int = 8  # the drafter's query heads (`--heads` names the head kind: dflash or dspark)
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    target_layer_ids: tuple[int, ...] | None = None  # default: spread over the target's depth
    mask_token_id: int | None = None  # default: the tokenizer's mask token
    steps: int = 2000
    batch: int = 16  # sequences per step
    anchors: int = 16  # blocks per sequence per step
    prompt_tokens: int = 128  # text each generated sequence starts from
    generated_tokens: int = 128  # the target's greedy continuation after it
    sequences: int | None = None  # sequences generated before training (None: `sequences_for(steps, batch)`)
    lr: float = 2e-3
    warmup: int = 50
    position_decay: float = 4.0  # block position j weighs exp(-(j - 1) / decay)
    seed: int = 0
    heads: str = "dflash"  # or "dspark": + the Markov and confidence heads (lucebox.models.dspark)
    markov_rank: int = 64  # the Markov head's rank, with heads "dspark"
    init: str | None = None  # a DFlash drafter folder whose backbone training starts from
    freeze_backbone: bool = False  # train the DSpark heads only (needs init)

    def __post_init__(self):  # named as `lucebox distill`'s flags
        if self.sequences is None:  # frozen: the documented way to fill a field in __post_init__
            object.__setattr__(self, "sequences", sequences_for(self.steps, self.batch))
        for name, (low, high) in RANGES.items():
            arguments.integer(flag_name(name), getattr(self, name), low, high)
        arguments.integer("--mask-token-id", self.mask_token_id, 0, 2**31 - 1, optional=True)
        arguments.integer("warmup", self.warmup, 0)
        arguments.number("--lr", self.lr, 0, 1, low_open=True)
        arguments.number("position_decay", self.position_decay, 0, low_open=True)
        arguments.choice("--heads", self.heads, HEADS)
        _check_together(self)


# The range of each integer setting with a `lucebox distill` flag: `__post_init__` checks it, and the
# flag's argparse type refuses a value outside it while the command line is parsed.
RANGES = {
    "layers": (1, 64), "block_size": (2, 256), "attention_heads": (1, 256), "kv_heads": (1, 256),
    "head_dim": (2, 1024), "intermediate_size": (1, 2**18), "steps": (1, 10**9), "batch": (1, 4096),
    "anchors": (1, 4096), "prompt_tokens": (1, 2**16), "generated_tokens": (0, 2**16), "sequences": (1, 10**7),
    "seed": (0, arguments.SEED_MAX), "markov_rank": (1, 65536),
}


def flag_name(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def _check_together(s: DistillSettings) -> None:
    """What no single flag's range can say: the drafter's heads, the sequences' room for the blocks."""
    if s.attention_heads % s.kv_heads:
        raise InvalidArgumentError(f"--attention-heads {s.attention_heads} is not a multiple of --kv-heads "
                                   f"{s.kv_heads}: each KV head serves the same number of query heads")
    if s.head_dim % 2:
        raise InvalidArgumentError(f"--head-dim {s.head_dim} must be even: rotary position embedding turns pairs")
    if s.prompt_tokens + s.generated_tokens < s.block_size + s.anchors - 1:
        raise InvalidArgumentError("sequences (--prompt-tokens + --generated-tokens) are too short for "
                                   "--anchors distinct blocks of --block-size")
    if s.heads == "mtp" and s.init is not None:
        raise InvalidArgumentError("--init starts from a DFlash or DSpark drafter; --heads mtp trains a new MTP head "
                                   "from the target's own layer: leave --init out")
    if s.freeze_backbone and (s.init is None or s.heads != "dspark"):
        raise InvalidArgumentError("--freeze-backbone trains the DSpark heads of an --init drafter: give "
                                   "--heads dspark and --init DRAFTER_FOLDER with it")


def sequences_for(steps: int, batch: int) -> int:
    """Sequences worth generating for a run: each is drawn about 8 times over the run, between 64
    (a short try finishes its generation in seconds) and 2048 (the built-in recipe's)."""
    return min(2048, max(64, steps * batch // 8))


def default_target_layers(num_layers: int, count: int = 3) -> tuple[int, ...]:
    """`count` decoder layers spread from the second to the second-to-last (shallow to deep features)."""
    first, last = min(1, num_layers - 1), max(0, num_layers - 2)
    count = min(count, last - first + 1)
    if count <= 1:
        return (last,)
    return tuple(sorted({round(first + k * (last - first) / (count - 1)) for k in range(count)}))


def drafter_config(target_hf: dict, target: Decoder, s: DistillSettings, mask_token_id: int) -> dict:
    cfg = target.cfg
    ids = list(s.target_layer_ids or default_target_layers(len(cfg.layers)))
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": cfg.hidden_size,
        "num_attention_heads": s.attention_heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": s.layers, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": target_hf.get("max_position_embeddings", 32768),
        "rope_theta": 10000.0, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "block_size": s.block_size, "num_target_layers": len(cfg.layers), "torch_dtype": "bfloat16",
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_token_id, "block_size": s.block_size},
    }


def init_drafter(dcfg: dflash.DFlashConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * dcfg.num_layers)
    weights = {}
    heads = head_names(dcfg)
    for name, shape in dflash.weight_shapes(dcfg).items():
        if name in heads:  # the heads start as no-ops (zero bias, confidence 0.5): training starts from the backbone
            weights[name] = torch.randn(shape, generator=g) * 0.01 if name == "markov_w1" else torch.zeros(shape)
        elif len(shape) == 1:
            weights[name] = torch.ones(shape)
        else:
            std = 0.02 * (out_scale if name.rsplit(".", 1)[-1] in ("wo", "w_down") else 1)
            weights[name] = torch.randn(shape, generator=g) * std
    return weights


def save_drafter(folder: Path, hf: dict, weights: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    dcfg = dflash.build_config(hf)
    tensors = {}
    for name, source in dflash.sources(dcfg).items():
        tensors.update(to_checkpoint(weights[name].detach().to(torch.bfloat16), source))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def generate_sequences(target: Decoder, stream: torch.Tensor, s: DistillSettings, batch: int = 16,
                       on_batch=None) -> torch.Tensor:
    """(sequences, prompt_tokens + generated_tokens): random windows of the text, each followed by
    the target's greedy continuation."""
    g = torch.Generator().manual_seed(s.seed + 1)
    starts = torch.randint(0, len(stream) - s.prompt_tokens, (s.sequences,), generator=g)
    out = []
    for begin in range(0, s.sequences, batch):
        rows = starts[begin : begin + batch]
        prompts = stream[rows[:, None] + torch.arange(s.prompt_tokens)]
        out.append(greedy_continuations(target, prompts, s.generated_tokens))
        if on_batch is not None:
            on_batch(min(begin + batch, s.sequences))
    return torch.cat(out)


def position_weights(s: DistillSettings) -> torch.Tensor:
    """(block_size - 1,) weights of block positions 1.. : early positions matter most (a rejected
    draft ends the round)."""
    return torch.exp(-torch.arange(s.block_size - 1, dtype=torch.float32) / s.position_decay)


def target_signals(target: Decoder, tokens: torch.Tensor, layers: tuple[int, ...]):
    """(hidden after the final norm (B, T, H), the drafter's input features (B, T, n*H)): the
    outputs of decoder `layers` that `DFlashProposer` reads from the verifying forward."""
    with torch.no_grad():
        return forward_batch(target, tokens, layers)


class TargetSignals:
    """`target_signals` of every sequence, computed once (the target is frozen) in batches."""

    def __init__(self, target: Decoder, sequences: torch.Tensor, layers: tuple[int, ...], batch: int = 32):
        parts = [target_signals(target, sequences[i : i + batch], layers) for i in range(0, len(sequences), batch)]
        self.hidden = torch.cat([h for h, _ in parts])  # (N, T, H)
        self.features = torch.cat([f for _, f in parts])  # (N, T, n*H)

    def __getitem__(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden[rows], self.features[rows]


def drafted_logits(drafter, target: Decoder, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                   frozen: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (B, M, bs-1, V), the drafter's final hidden (B, M, bs-1, H), each row's previous token
    (B, M, bs-1)) of block rows 1.. of the blocks at anchors (B, M). With DSpark heads the logits
    carry the Markov bias of the token at a + j - 1, teacher-forced: the sequence's token there
    (after the prompt, the target's greedy one), where inference has the draft before. `frozen`:
    the backbone is not trained, so it runs without building a graph."""
    rows = anchors[:, :, None] + torch.arange(drafter.cfg.block_size - 1)  # (B, M, bs-1): row j is a + j - 1
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        drafted = draft_hidden(drafter, target, features, tokens, anchors)[:, :, 1:]  # (B, M, bs-1, H)
        logits = drafter.logits(target, drafted)
    prev = tokens.gather(1, rows.flatten(1)).view(*rows.shape)
    if drafter.heads is not None:
        logits = drafter.heads.position_logits(logits, prev)
    return logits, drafted, prev


def distill_loss(drafter, target: Decoder, tokens: torch.Tensor, anchors: torch.Tensor, weights: torch.Tensor,
                 signals: tuple[torch.Tensor, torch.Tensor] | None = None, frozen: bool = False):
    """(loss, drafter-argmax == target-argmax rate per block position) for tokens (B, T), anchors (B, M).
    Block row j of the block at a is trained toward the target's distribution for position a + j
    (`drafted_logits`; with DSpark heads plus the confidence head's loss). `signals`: the tokens'
    `target_signals`, if already computed."""
    hidden, features = signals or target_signals(target, tokens, drafter.cfg.target_layer_ids)
    with torch.no_grad():
        rows = anchors[:, :, None] + torch.arange(drafter.cfg.block_size - 1)  # (B, M, bs-1): row a+j-1
        target_hidden = hidden.gather(1, rows.reshape(len(tokens), -1, 1).expand(-1, -1, hidden.shape[-1]))
        p = torch.softmax(target.logits(target_hidden).float(), dim=-1)  # (B, M*(bs-1), V)
    logits, drafted, prev = drafted_logits(drafter, target, features, tokens, anchors, frozen)
    logq = torch.log_softmax(logits.flatten(1, 2), dim=-1)
    per_row = -(p * logq).sum(-1).view(*rows.shape)  # (B, M, bs-1)
    loss = (per_row * weights).sum(-1).mean() / weights.sum()
    if drafter.heads is not None and drafter.heads.cfg.confidence:
        loss = loss + confidence_loss(drafter.heads, drafted, prev, p.view(*logits.shape), logq.view(*logits.shape),
                                      weights)
    agree = (logq.argmax(-1) == p.argmax(-1)).float().view(*rows.shape).mean((0, 1))
    return loss, agree


def sample_anchors(n: int, T: int, s: DistillSettings, g: torch.Generator) -> torch.Tensor:
    """(n, anchors) block starts, distinct per sequence, leaving room for a whole block."""
    return torch.rand(n, T - s.block_size + 1, generator=g).argsort(dim=1)[:, : s.anchors].sort(dim=1).values


def start_training(weights: dict, trained: list, s: DistillSettings, state_path: Path):
    """(AdamW over `trained`, the step sampler's generator, the step to start from, the log): new,
    or as `state_path` left them (`weights` restored in place)."""
    optimizer = torch.optim.AdamW(trained, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(s.seed + 2)
    start, log, state = load_state(state_path, weights, optimizer)
    if state:
        g.set_state(state["generator"])
    return optimizer, g, start, log


def set_learning_rate(optimizer, step: int, s: DistillSettings) -> None:
    """Warm-up, then cosine down to a tenth of `s.lr` over `s.steps`."""
    from lucebox.training.target import learning_rate

    schedule = dataclasses.make_dataclass("Schedule", ["lr", "warmup", "steps", "min_lr_ratio"])(
        s.lr, s.warmup, s.steps, 0.1)
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, schedule)


def train_drafter(target: Decoder, hf: dict, sequences: torch.Tensor, s: DistillSettings, state_path: Path,
                  on_step=None) -> tuple[dict, list[dict]]:
    """Distill from scratch or resume from `state_path`; returns (drafter weights, log)."""
    torch.manual_seed(s.seed)
    dcfg = dflash.build_config(hf)
    weights = init_drafter(dcfg, s.seed)
    if s.init:
        weights.update(load_start(s.init, with_heads=dcfg.heads is not None))
    trained = [w.requires_grad_() for n, w in weights.items() if not s.freeze_backbone or n in head_names(dcfg)]
    drafter = dflash.DFlashDrafter(dcfg, weights)
    optimizer, g, start, log = start_training(weights, trained, s, state_path)
    position_w = position_weights(s)
    signals = TargetSignals(target, sequences, dcfg.target_layer_ids)
    t0 = time.perf_counter()
    for step in range(start, s.steps):
        set_learning_rate(optimizer, step, s)
        rows = torch.randint(0, len(sequences), (s.batch,), generator=g)
        tokens = sequences[rows]
        anchors = sample_anchors(s.batch, tokens.shape[1], s, g)
        loss, agree = distill_loss(drafter, target, tokens, anchors, position_w, signals[rows], s.freeze_backbone)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        record = {"step": step + 1, "loss": round(loss.item(), 4),
                  "agree_first": round(agree[0].item(), 3), "agree_mean": round(agree.mean().item(), 3),
                  "s_per_step": round((time.perf_counter() - t0) / (step + 1 - start), 3)}
        if step % 10 == 0 or step + 1 == s.steps:
            log.append({**record, "agree_by_position": [round(a, 3) for a in agree.tolist()]})
        if on_step is not None:
            on_step(step + 1, record)
        if (step + 1) % 100 == 0 or step + 1 == s.steps:
            save_state(state_path, step + 1, weights, optimizer, log, generator=g.get_state())
    return {n: w.detach() for n, w in weights.items()}, log
