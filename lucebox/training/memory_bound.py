"""Whether a training run fits in host memory, worked out from its sizes before anything is
allocated (as `lucebox.memory.plan` does for inference): a config.json or flags whose tensors would
not fit stop with an InsufficientMemoryError naming what to make smaller, instead of an allocation
failure, or the kernel's OOM killer, minutes in. The figures are estimates (within a factor of
about two); what they catch is a size far beyond the machine, such as a hidden_size of 65536."""

from __future__ import annotations

import math

from lucebox.config import ModelConfig
from lucebox.errors import InsufficientMemoryError
from lucebox.memory.plan import HEADROOM, _host_available
from lucebox.models import build_model_config
from lucebox.models.layout import weight_shapes

FLOAT = 4  # training runs in float32
PER_PARAMETER = 4 * FLOAT  # the weight, its gradient and AdamW's two moments
# config.json sizes a message may name as the one to make smaller
SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size")


def parameters(cfg: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in weight_shapes(cfg).values())


def _mlp_width(cfg: ModelConfig, layer) -> int:
    """Intermediate rows one token computes in `layer`'s MLP (for MoE: its chosen experts and the shared one)."""
    if layer.mlp == "moe" and cfg.moe is not None:
        return cfg.moe.top_k * cfg.moe.expert_size + cfg.moe.shared_expert_size
    return cfg.intermediate_size


def activation_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """What a forward keeps for the backward pass, per sequence of `length` tokens: per layer about
    16 hidden-sized rows (norms, projections, residuals), 6 MLP-wide ones (gate, up, activation and
    their gradients) and one attention score per head and attended position; then the logits,
    their log-softmax and its gradient."""
    per_token = 0
    for layer in cfg.layers:
        attended = min(length, layer.window or length)
        per_token += 16 * cfg.hidden_size + 6 * _mlp_width(cfg, layer) + layer.num_heads * attended
    per_token += 3 * cfg.vocab_size
    return batch * length * per_token * FLOAT


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _largest_size(hf: dict, reference: dict) -> str | None:
    """The config.json size furthest above the `reference` config's, if one is above it."""
    def ratio(key: str) -> float:
        return hf[key] / reference[key] if isinstance(reference.get(key), int) and reference[key] > 0 else 0.0

    sized = [key for key in SIZE_FIELDS if isinstance(hf.get(key), int) and not isinstance(hf.get(key), bool)]
    key = max(sized, key=ratio, default=None)
    return key if key is not None and ratio(key) > 1 else None


def check_training_fits(hf: dict, batch: int, length: int, source: str, reference: dict) -> None:
    """Refuse training the model `hf` describes on batches of `batch` x `length` tokens when its
    weights, gradients, AdamW state and activations would not fit in the host memory available.
    `source` names where `hf` came from; `reference` is a config known to train (the built-in one):
    the size furthest above its own is named as the one to make smaller."""
    cfg = build_model_config(hf)
    weights = parameters(cfg) * PER_PARAMETER
    activations = activation_bytes(cfg, batch, length)
    available = HEADROOM * _host_available()
    if weights + activations <= available:
        return
    field = _largest_size(hf, reference)
    culprit = f"{source}: {field} {hf[field]} (a model of {parameters(cfg) / 1e9:.2f} G parameters) with " if field \
        else ""
    raise InsufficientMemoryError(
        f"{culprit}--batch {batch} x --length {length} needs about {_gib(weights + activations)} to train "
        f"({_gib(weights)} for the weights, their gradients and AdamW state, {_gib(activations)} for activations), "
        f"more than the {_gib(available)} of host memory available; "
        + (f"make {field} smaller, or " if field else "") + "lower --batch or --length")


def check_distill_fits(target: ModelConfig, drafter, s) -> None:
    """Refuse a distill run (settings `s`, a `DistillSettings`) whose largest buffers would not fit in
    the host memory available, naming the flags that size the largest: the target's features of
    every sequence (kept for the whole run), one step's soft labels and logits, the drafter with its
    gradients and AdamW state. `drafter`: its `DFlashConfig`, or None for an MTP head (one layer
    shaped after the target's; its labels and logits cover every row of the batch, at two depths)."""
    from lucebox.models import dflash, mtp

    tokens = s.prompt_tokens + s.generated_tokens
    if drafter is None:
        head = mtp.head_shapes(mtp.head_config(target))
        step = f"--batch {s.batch} x {tokens} tokens: a step's soft labels and logits at two depths"
        parts = {f"--sequences {s.sequences} x {tokens} tokens (--prompt-tokens + --generated-tokens): the target's "
                 "states": s.sequences * tokens * target.hidden_size * FLOAT,
                 step: 6 * s.batch * tokens * target.vocab_size * FLOAT,
                 "the head (the target's layer)": sum(math.prod(shape) for shape in head.values()) * PER_PARAMETER}
    else:
        parts = {
            f"--sequences {s.sequences} x {tokens} tokens (--prompt-tokens + --generated-tokens): the target's "
            "features": s.sequences * tokens * target.hidden_size * (1 + len(drafter.target_layer_ids)) * FLOAT,
            f"--batch {s.batch} x --anchors {s.anchors} x --block-size {drafter.block_size}: a step's logits":
                4 * s.batch * s.anchors * (drafter.block_size - 1) * target.vocab_size * FLOAT,
            f"--layers {drafter.num_layers}, --intermediate-size {drafter.intermediate_size} and the heads: the "
            "drafter": sum(math.prod(shape) for shape in dflash.weight_shapes(drafter).values()) * PER_PARAMETER,
        }
    available = HEADROOM * _host_available() - parameters(target) * FLOAT  # the target is held in float32
    if sum(parts.values()) <= available:
        return
    largest = max(parts, key=parts.get)
    raise InsufficientMemoryError(f"{largest} need about {_gib(parts[largest])} (everything: "
                                  f"{_gib(sum(parts.values()))}), more than the {_gib(max(available, 0))} of host "
                                  "memory available beside the target; make them smaller")
