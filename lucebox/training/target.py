"""Training a small Laguna-architecture code model from scratch on the CPU (or a GPU), with the
engine's own decoder: the built-in model's recipe.

Routing balance is kept the way Laguna's family does it, without an auxiliary loss: after every
step each MoE layer's selection-only correction bias moves toward under-used experts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from lucebox import arguments
from lucebox.kernels.backend import kernels_for
from lucebox.kernels.moe import moe_experts
from lucebox.models import adapter_for, build_model_config
from lucebox.models.decoder import Decoder
from lucebox.models.layout import weight_shapes
from lucebox.models.sources import to_checkpoint
from lucebox.training.checkpointing import load_state, save_state
from lucebox.training.forward import forward_batch

# The built-in model: every feature of Laguna XS.2 at a size that trains on two CPU cores.
BUILTIN_CONFIG = {
    "architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 4096, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_attention_heads_per_layer": [8, 6, 6, 6, 8, 6, 6, 6], "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "attention_bias": False, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128, "moe_routed_scaling_factor": 2.5,
    "moe_router_logit_softcapping": 0.0, "moe_apply_router_weight_on_input": False,
    "mlp_layer_types": ["dense"] + ["sparse"] * 7,
    "layer_types": (["full_attention"] + ["sliding_attention"] * 3) * 2, "sliding_window": 128,
    "gating": True,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 3000
    batch: int = 8
    length: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    bias_update: float = 1e-3  # routing balance: how far a correction bias moves per step
    seed: int = 0
    eval_every: int = 250
    save_every: int = 250

    def __post_init__(self):  # named as `lucebox train`'s flags
        for name, (low, high) in RANGES.items():
            arguments.integer("--" + name.replace("_", "-"), getattr(self, name), low, high)
        for name in ("warmup", "save_every"):
            arguments.integer(name, getattr(self, name), 1 if name == "save_every" else 0)
        arguments.number("--lr", self.lr, 0, 1, low_open=True)
        for name in ("min_lr_ratio", "weight_decay", "clip", "bias_update"):
            arguments.number(name, getattr(self, name), 0)


# The range of each integer setting with a `lucebox train` flag: `__post_init__` checks it, and the
# flag's argparse type refuses a value outside it while the command line is parsed.
RANGES = {"steps": (1, 10**9), "batch": (1, 65536), "length": (2, 2**20), "eval_every": (1, 10**9),
          "seed": (0, arguments.SEED_MAX)}
VOCAB_SIZES = (260, 2**18)  # byte fallback's 256 pieces and <unk> <s> </s> <mask> at least


def init_weights(hf: dict, seed: int) -> dict[str, torch.Tensor]:
    """N(0, 0.02) matrices, output projections scaled down by the depth, unit norms, zero biases."""
    cfg = build_model_config(hf)
    g = torch.Generator().manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * len(cfg.layers))
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 1:
            weights[name] = (torch.zeros if name.endswith("router_bias") else torch.ones)(shape)
            continue
        std = 0.02 * (out_scale if name.rsplit(".", 1)[-1] in ("wo", "w_down", "experts_down", "shared_down") else 1)
        weights[name] = torch.randn(shape, generator=g) * std
    return weights


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class RoutingCounter:
    """A torch kernel table whose MoE op also counts how often each expert is chosen, per layer call."""

    def __init__(self):
        self.counts: list[torch.Tensor] = []
        self.kernels = dataclasses.replace(kernels_for("torch"), moe_experts=self._moe)

    def _moe(self, x, gate_up, down, weights, ids, *rest):
        self.counts.append(torch.bincount(ids.reshape(-1), minlength=gate_up.shape[0]))
        return moe_experts(x, gate_up, down, weights, ids, *rest)


def balance_routing(weights: dict, cfg, counts: list[torch.Tensor], rate: float) -> None:
    """Move each MoE layer's correction bias toward the experts it chose less than average."""
    moe_layers = [i for i, layer in enumerate(cfg.layers) if layer.mlp == "moe"]
    with torch.no_grad():
        for i, count in zip(moe_layers, counts, strict=True):
            load = count.float()
            weights[f"layers.{i}.router_bias"] += rate * torch.sign(load.mean() - load)


def lm_loss(decoder: Decoder, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    hidden, _ = forward_batch(decoder, inputs)
    return F.cross_entropy(decoder.logits(hidden).flatten(0, 1).float(), labels.reshape(-1))


@torch.no_grad()
def evaluate_bits(decoder: Decoder, documents: list[list[int]], length: int, batch: int = 8) -> float:
    """Total bits (-log2 p) the model spends on `documents` ([BOS] ... [EOS] each), every token after
    BOS predicted from its own document only. Windows of `length` tokens advance by half a window
    and score their second half, so every token but the first window's has at least length / 2
    tokens of context (the usual sliding-window perplexity)."""
    stride = max(1, length // 2)
    jobs = []  # (window of at most length + 1 ids, how many of its last predictions are scored)
    for doc in (d for d in documents if len(d) >= 2):
        done = min(len(doc), length + 1)
        jobs.append((doc[:done], done - 1))
        while done < len(doc):
            end = min(len(doc), done + stride)
            jobs.append((doc[end - length - 1 : end], end - done))
            done = end
    return _score(decoder, jobs, batch)


def _score(decoder: Decoder, jobs: list[tuple[list[int], int]], batch: int) -> float:
    jobs = sorted(jobs, key=lambda j: len(j[0]))
    bits = 0.0
    for begin in range(0, len(jobs), batch):
        group = jobs[begin : begin + batch]
        same = all(len(w) == len(group[0][0]) for w, _ in group)
        for part in ([group] if same else [[j] for j in group]):  # sorted: few windows run alone
            ids = torch.tensor([w for w, _ in part])
            hidden, _ = forward_batch(decoder, ids[:, :-1])
            logp = torch.log_softmax(decoder.logits(hidden).double(), dim=-1)
            token_bits = -logp.gather(2, ids[:, 1:, None])[..., 0] / math.log(2)  # (b, n)
            bits += sum(token_bits[r, token_bits.shape[1] - scored :].sum().item()
                        for r, (_, scored) in enumerate(part))
    return bits


def save_model(folder: Path, hf: dict, weights: dict, generation: dict | None = None) -> None:
    """A Hugging Face folder: config.json, model.safetensors (published names, bf16), generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = build_model_config(hf)
    tensors = {}
    for name, source in adapter_for(hf).sources(cfg).items():
        tensors.update(to_checkpoint(weights[name].detach().to(torch.bfloat16), source))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    gen = generation or {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def train(hf: dict, stream, evaluate, s: TrainSettings, state_path: Path, on_step=None) -> tuple[dict, list[dict]]:
    """Train from scratch (or resume from `state_path`); returns (weights, log). `evaluate(decoder,
    final)` returns the held-out figures logged every `eval_every` steps (final: on all of it);
    `on_step(step, record)` sees every step's record (for a progress display)."""
    from lucebox.training.corpus import Batches

    torch.manual_seed(s.seed)
    cfg = build_model_config(hf)
    weights = init_weights(hf, s.seed)
    trained = {n: w.requires_grad_() for n, w in weights.items() if not n.endswith("router_bias")}
    decay = [w for n, w in trained.items() if w.dim() >= 2]
    no_decay = [w for n, w in trained.items() if w.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    batches = Batches(stream, s.batch, s.length, s.seed)
    start, log, _ = load_state(state_path, weights, optimizer)
    for _ in range(start):  # resume: the batch sampler where it was
        batches.next()
    counter = RoutingCounter()
    decoder = Decoder(cfg, weights, counter.kernels)
    t0, tokens = time.perf_counter(), 0
    for step in range(start, s.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, s)
        inputs, labels = batches.next()
        counter.counts.clear()
        loss = lm_loss(decoder, inputs, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(trained.values()), s.clip)
        optimizer.step()
        balance_routing(weights, cfg, counter.counts, s.bias_update)
        tokens += inputs.numel()
        record = {"step": step + 1, "loss": round(loss.item(), 4), "lr": learning_rate(step, s),
                  "tokens_per_s": round(tokens / (time.perf_counter() - t0), 1)}
        last = step + 1 == s.steps
        if (step + 1) % s.eval_every == 0 or last:
            record.update(evaluate(decoder, last))
        if last or (step + 1) % s.eval_every == 0 or step % 10 == 0:
            log.append(record)
        if on_step is not None:
            on_step(step + 1, record)
        if (step + 1) % s.save_every == 0 or last:
            save_state(state_path, step + 1, weights, optimizer, log)
    return {n: w.detach() for n, w in weights.items()}, log
