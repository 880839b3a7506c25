"""The one decoder every architecture runs on: a `ModelConfig` plus a flat dict of tensors.

Activations are (N, H) for the N rows of one forward: a prefill chunk, one decode token or a
verify block of the one sequence the runtime serves, or the B*T rows of a training batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.backend import Kernels, kernels_for
from lucebox.kernels.cpu_rows import PackedWeight
from lucebox.kernels.moe import swiglu
from lucebox.kernels.quant import QuantizedTensor, kept_dense
from lucebox.kernels.rope import RotaryTables
from lucebox.models.cache_contexts import CacheContext
from lucebox.models.token_mixers import ForwardContext, token_mixer

from lucebox.caches import SequenceCache, Step
from lucebox.config import LayerSpec, ModelConfig

# The RMSNorm weights `ModelConfig.norm_offset` applies to (a Gated DeltaNet's own gated norm is plain).
OFFSET_NORMS = ("attn_norm", "mlp_norm", "norm", "q_norm", "k_norm")


class Decoder:
    """`weights` maps internal names to tensors, or to `QuantizedTensor`s for quantized linear
    layers; `kernels` is the backend's operator table (the torch references by default).

    Every forward (eager decoding, the graphed step, both training forwards) runs `run`: embed,
    then each layer through `run_layer`, with a `ForwardContext` saying how its rows reach their
    keys."""

    def __init__(self, cfg: ModelConfig, weights: dict, kernels: Kernels | None = None):
        self.cfg = cfg
        if cfg.norm_offset:
            # RMSNorm by (offset + weight) (Qwen3-Next): the offset is added once here, so every norm
            # kernel stays plain. The decoder's weights then differ from the checkpoint's by it.
            for name in [n for n in weights if n.rsplit(".", 1)[-1] in OFFSET_NORMS]:
                weights[name] = weights[name] + cfg.norm_offset
        self.w = weights
        first = weights["embed"]
        self.dtype, self.device = first.dtype, first.device
        self.rope = RotaryTables(self.device)
        self.scale = cfg.head_dim**-0.5
        self.kernels = kernels or kernels_for("torch")
        self._packed_head: PackedWeight | None = None
        layers = len(cfg.layers)
        self._mlp_norm = [f"layers.{i}.mlp_norm" for i in range(layers)]
        # Each residual add is fused with the norm that reads its result: the next layer's, or the final one.
        self._next_norm = [f"layers.{i + 1}.attn_norm" for i in range(layers - 1)] + ["norm"]

    @property
    def kernels(self) -> Kernels:
        return self._kernels

    @kernels.setter
    def kernels(self, table: Kernels) -> None:
        # The token mixers hold the table they run with, so a new one (a test's spy) reaches them too.
        self._kernels = table
        self.mixers = [token_mixer(self.cfg, i, self.w, table, self.rope) for i in range(len(self.cfg.layers))]

    def forward(
        self,
        token_ids: torch.Tensor,  # (T,) int64
        step: Step,
        cache: SequenceCache,
    ) -> torch.Tensor:  # (T, H), after the final norm
        return self.forward_capturing(token_ids, step, cache, ())[0]

    def forward_capturing(
        self, token_ids: torch.Tensor, step: Step, cache: SequenceCache, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run` of one eager step over `cache`, writing the step's rows into it."""
        return self.run(token_ids, CacheContext(step, cache, self.kernels, self.scale), layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, V)
        # An "lm_head" beside a tied table is its int8 copy (`lucebox.memory.lm_head`): the lookup keeps the floats.
        head = self.w.get("lm_head", self.w["embed"])
        if isinstance(head, QuantizedTensor):
            dense = kept_dense(head)  # on the CPU, the codes' float values kept once: packed below
            if dense is None:
                return self.kernels.linear(hidden, head)  # the backend's kernels read the codes
            head = dense
        if self.device.type != "cpu":
            return F.linear(hidden, head)
        if self._packed_head is None or self._packed_head.weight is not head:
            self._packed_head = PackedWeight(head)  # a step's rows: the same bits at any width (`cpu_rows`)
        return self._packed_head(hidden)

    # -- the one layer loop, for every kind of forward --------------------------------------------------------

    def run(self, token_ids: torch.Tensor, context: ForwardContext,
            capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """token_ids (N,) -> (hidden (N, H) after the final norm, the outputs of decoder layers
        `capture` side by side (N, len(capture) * H), or None: what a DFlash drafter reads), every
        layer reaching its context through `context`."""
        x, h = self.embed(token_ids)
        captured: dict[int, torch.Tensor] = {}
        for i in range(len(self.mixers)):
            x, h = self.run_layer(i, x, h, context)
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return h, features

    def embed(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, first layer's normed input h), both (N, H)."""
        x = F.embedding(token_ids, self.w["embed"])
        return x, self.kernels.rms_norm(x, self.w["layers.0.attn_norm"], self.cfg.rms_norm_eps)

    def run_layer(self, i: int, x: torch.Tensor, h: torch.Tensor,
                  context: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on the residual stream x and its normed input h (both (N, H)): the token mixer,
        residual add + the MLP's norm, a dense SwiGLU MLP or routed experts, residual add + the
        next layer's norm (the final norm after the last layer): the next (x, h)."""
        w, k, eps = self.w, self.kernels, self.cfg.rms_norm_eps
        mix = getattr(context, "mix", None)  # a forward over several sequences runs some mixers per sequence
        mixed = self.mixers[i].mix(h, context) if mix is None else mix(self.mixers[i], h)
        x, h = k.add_rms_norm(x, mixed, w[self._mlp_norm[i]], eps)
        return k.add_rms_norm(x, self._mlp(i, self.cfg.layers[i], h), w[self._next_norm[i]], eps)

    def _mlp(self, i: int, layer: LayerSpec, h: torch.Tensor) -> torch.Tensor:
        w, k, p = self.w, self.kernels, f"layers.{i}."
        if layer.mlp == "dense":
            return swiglu(h, w[p + "w_gate_up"], w[p + "w_down"], k.linear)
        moe = self.cfg.moe
        weights, ids = k.moe_route(h, w[p + "router"], moe, w.get(p + "router_bias"))
        # A gated shared expert (Qwen3-Next: sigmoid(h . shared_gate) times its output) runs beside the
        # routed experts; an ungated one runs inside the experts' kernel.
        gated = moe.shared_expert_gate
        shared = (w[p + "shared_gate_up"], w[p + "shared_down"]) if moe.shared_expert_size and not gated else ()
        if p + "experts" in w:  # experts in host memory, a device cache of them (lucebox.memory.expert_cache)
            out = w[p + "experts"].moe(k.moe_experts, h, weights, ids, moe.routed_scaling, *shared)
        else:
            out = k.moe_experts(h, w[p + "experts_gate_up"], w[p + "experts_down"], weights, ids, moe.routed_scaling,
                                *shared)
        if gated:
            gate = torch.sigmoid(k.linear(h, w[p + "shared_gate"]))  # (N, 1)
            out = out + gate * swiglu(h, w[p + "shared_gate_up"], w[p + "shared_down"], k.linear)
        return out
