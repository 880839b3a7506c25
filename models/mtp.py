"""The multi-token-prediction (MTP) head Qwen3-Next and Qwen3.5/3.6 checkpoints ship beside the
model (`mtp_num_hidden_layers: 1` in config.json, tensors under `mtp.`): one more decoder layer
that predicts the token after next.

Row t of the head reads the token at t + 1 and the target's final hidden state at t (after its
final norm): each is RMS-normed (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), the two are
concatenated (embedding first) and `fc` maps them back to the hidden size; then one full-attention
decoder layer with the model's own MLP kind (`mtp.layers.0.*`, named as the model's layers are),
and `mtp.norm`. Its output predicts the token at t + 2 through the model's LM head, and is the
hidden state the next row reads when the head drafts on from its own token. Every norm scales by
(1 + weight), as the model's do; the embedding table and the LM head are the model's.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from lucebox.models.cache_contexts import CacheContext
from lucebox.models.decoder import Decoder
from lucebox.models.fused_projections import fuse_attention_projections
from lucebox.models.layout import hf_sources, weight_shapes
from lucebox.models.sources import AnyOf, Source, Unloaded, renamed
from lucebox.models.token_mixers import ForwardContext

from lucebox.caches import SequenceCache, Step
from lucebox.config import ModelConfig
from lucebox.errors import DraftModelError

PREFIX = "mtp."
# Our names of the head's own tensors beyond its decoder layer, and theirs in the checkpoint.
INPUT_TENSORS = {"fc": "mtp.fc.weight", "norm_embedding": "mtp.pre_fc_norm_embedding.weight",
                 "norm_hidden": "mtp.pre_fc_norm_hidden.weight"}
_SHARED = ("embed", "lm_head")  # the model's own tensors, never read again for the head
# Loading the head from the model's checkpoint leaves the model's tensors to the model's load.
THE_MODEL = (Unloaded("model.", "the model", quiet=True), Unloaded("lm_head.weight", "the model", quiet=True))


def declared_layers(hf: dict) -> int:
    """`mtp_num_hidden_layers` of a config.json (an image-text one's text_config), or DeepSeek-V3's
    `num_nextn_predict_layers` (GLM-4.5's); 0 when absent (then the checkpoint's own tensors say
    whether there is a head)."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = text.get(key, hf.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def source_layer(target: ModelConfig) -> int:
    """The target's layer the head's is shaped after (and a trained head starts from): its last
    full-attention layer."""
    full = [i for i, layer in enumerate(target.layers) if layer.attention == "full"]
    if not full:
        raise DraftModelError("this model has no full-attention layer to shape an MTP head's layer after")
    return full[-1]


def head_config(target: ModelConfig) -> ModelConfig:
    """The head as a one-layer model: the target's full-attention layer, with an MoE MLP when the
    target has experts (as the published heads do), else a dense one."""
    layer = replace(target.layers[source_layer(target)], mlp="moe" if target.moe is not None else "dense")
    return replace(target, layers=(layer,))


def _to_checkpoint(name: str) -> str:
    if name == "model.norm.weight":
        return PREFIX + "norm.weight"
    return name.replace("model.layers.0.", PREFIX + "layers.0.", 1)


def deepseek_layer(at: int) -> dict[str, str]:
    """DeepSeek-V3's names of the head's tensors (GLM-4.5 keeps its head so): one more decoder layer,
    `model.layers.{at}.` with `at` the model's layer count, its input tensors and final norm beside
    the layer's own (and copies of the embedding and the LM head, which the model's load leaves)."""
    p = f"model.layers.{at}."
    return {"fc": p + "eh_proj.weight", "norm_embedding": p + "enorm.weight", "norm_hidden": p + "hnorm.weight",
            "model.norm.weight": p + "shared_head.norm.weight", "model.layers.0.": p}


def head_sources(cfg: ModelConfig, layout: str = "checkpoint", at: int = 0) -> dict[str, Source]:
    """Where the head's tensors are: in the checkpoint (the layer's named like the model's layer 0),
    DeepSeek-V3's layer after the model's (`layout` "deepseek", at layer `at`: `deepseek_layer`), or
    in the Speculators library's "mtp" layout (`layout` "speculators": `SPECULATORS_NAMES`, the
    experts' fused tensors first, as its converter writes them)."""
    if layout == "deepseek":
        names = deepseek_layer(at)

        def to_layer(name: str) -> str:
            return names.get(name) or name.replace("model.layers.0.", names["model.layers.0."], 1)

        own = {name: renamed(source, to_layer) for name, source in hf_sources(cfg).items() if name not in _SHARED}
        return {**own, **{name: names[name] for name in INPUT_TENSORS}}
    own = {name: renamed(source, _to_checkpoint) for name, source in hf_sources(cfg).items() if name not in _SHARED}
    sources = {**own, **INPUT_TENSORS}
    if layout != "speculators":
        return sources
    fused_first = {name: AnyOf(tuple(reversed(source.options))) if name.endswith(("experts_gate_up", "experts_down"))
                   and isinstance(source, AnyOf) else source for name, source in sources.items()}
    return {name: renamed(source, _speculators_name) for name, source in fused_first.items()}


# The Speculators library's names for the head's tensors (speculators 0.9's MTP converter), by prefix.
SPECULATORS_NAMES = (("mtp.fc.weight", "mtp_layers.0.input_proj.weight"),
                     ("mtp.norm.weight", "mtp_layers.0.final_layernorm.weight"),
                     ("mtp.pre_fc_norm_hidden.weight", "mtp_layers.0.hidden_layernorm.weight"),
                     ("mtp.pre_fc_norm_embedding.weight", "mtp_layers.0.token_layernorm.weight"),
                     ("mtp.layers.0.", "mtp_layers.0."))


def _speculators_name(name: str) -> str:
    for ours, theirs in SPECULATORS_NAMES:
        if name == ours or (ours.endswith(".") and name.startswith(ours)):
            return theirs + name[len(ours):]
    return name


def speculators_config(target_text: dict, verifier: dict, drafts: int = 3) -> dict:
    """The Speculators "mtp" config.json of a head for the model whose text config is `target_text`
    (`verifier`: its name_or_path and architectures)."""
    return {"speculators_model_type": "mtp", "architectures": ["MTPDraftModel"],
            "transformer_layer_config": target_text, "num_nextn_predict_layers": 1,
            "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy", "verifier": verifier,
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafts}]}}


def head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    own = {name: shape for name, shape in weight_shapes(cfg).items() if name not in _SHARED}
    return {**own, "fc": (H, 2 * H), "norm_embedding": (H,), "norm_hidden": (H,)}


class MTPHead:
    """The head's forward over rows of (next token, hidden state), through its own cache."""

    def __init__(self, cfg: ModelConfig, weights: dict, target: Decoder):
        inputs = {name: weights.pop(name) for name in INPUT_TENSORS}
        for name in ("norm_embedding", "norm_hidden"):
            inputs[name] = inputs[name] + cfg.norm_offset  # as `Decoder` offsets the layer's norms
        self.fc, self.norm_embedding, self.norm_hidden = inputs["fc"], inputs["norm_embedding"], inputs["norm_hidden"]
        weights["embed"] = target.w["embed"]  # the model's table, shared (the layer reads no other shared tensor)
        fuse_attention_projections(cfg, weights)
        self.layer = Decoder(cfg, weights, target.kernels)
        self.cfg, self.target = cfg, target

    @property
    def weights(self) -> list:
        """The head's own tensors (the shared embedding table left out)."""
        own = [t for name, t in self.layer.w.items() if name != "embed"]
        return [*own, self.fc, self.norm_embedding, self.norm_hidden]

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, step: Step, cache: SequenceCache) -> torch.Tensor:
        """tokens (N,) at positions t + 1 and the hidden states (N, H) at t, for the N positions t
        of `step`: the head's output hidden states (N, H), written into `cache`."""
        return self.run(tokens, hidden, CacheContext(step, cache, self.layer.kernels, self.layer.scale))

    def run(self, tokens: torch.Tensor, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """`forward` with the layer reaching its keys through `context` (a training batch's too)."""
        layer = self.layer
        k, eps = layer.kernels, self.cfg.rms_norm_eps
        embedded = k.rms_norm(F.embedding(tokens, layer.w["embed"]), self.norm_embedding, eps)
        x = k.linear(torch.cat([embedded, k.rms_norm(hidden, self.norm_hidden, eps)], dim=-1), self.fc)
        h = k.rms_norm(x, layer.w["layers.0.attn_norm"], eps)
        return layer.run_layer(0, x, h, context)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)
