"""The one normalized model description every part of the engine reads.

Architecture adapters (`lucebox.models.*`) build a `ModelConfig` from a Hugging Face
`config.json`. Per-layer facts (attention kind, window, head count, RoPE, MLP kind) live in
`layers`, so the engine never branches on the architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lucebox.errors import ConfigError


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind. `rotary_dim` <= head_dim (partial rotary)."""

    theta: float
    rotary_dim: int
    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: derived from factor (and mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # Divisors of each frequency (rotary_dim/2 of them), as a llama.cpp GGUF file stores Llama 3's
    # RoPE scaling: its `rope_freqs` tensor, applied on top of `kind`.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer is: attention kind, head count, RoPE, MLP kind."""

    # "full" | "sliding" (attention over a KV cache) | "gdn" (Gated DeltaNet) | "kda" (Kimi Delta
    # Attention): the last two keep a recurrent state
    attention: str
    num_heads: int
    rope: RopeSpec
    mlp: str  # "dense" | "moe"
    window: int | None = None  # sliding layers: a query sees the last `window` positions, itself included

    @property
    def is_sliding(self) -> bool:
        return self.attention == "sliding"

    @property
    def is_recurrent(self) -> bool:
        """A linear-recurrent token mixer: a fixed-size state per sequence, no K/V rows."""
        return self.attention in RECURRENT_KINDS


RECURRENT_KINDS = ("gdn", "kda")


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Shapes of the recurrent layers, Gated DeltaNet or KDA (one spec shared by all of them). Each
    key head serves value_heads // key_heads value heads (KDA: one); the conv runs over q, k and v
    channels together. `projections` is the row order of GDN's fused input projections
    (`models/gated_deltanet.py`): "grouped" per key head (Qwen3-Next) or "flat", each of q, k, v,
    z, b, a whole (Qwen3.5); KDA's are separate tensors, its conv channels q | k | v ("flat")."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    projections: str = "grouped"  # "grouped" | "flat"

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_elements(self) -> tuple[int, int]:
        """(conv state, recurrent state) elements of one layer: the last conv_kernel - 1 conv
        inputs, and a key_dim x value_dim matrix per value head."""
        return (self.conv_kernel - 1) * self.conv_channels, self.value_heads * self.key_dim * self.value_dim


@dataclass(frozen=True)
class LatentAttentionSpec:
    """Multi-head latent attention (MLA, DeepSeek-V2 style; Kimi Linear's full layers): K and V of
    every head come from one shared latent of `kv_rank` (RMS-normed) and a `rope_dim` part of the
    key that all heads share; q from the hidden state directly or through a `q_rank` latent (0: none).
    A head's query and key are nope_dim + rope_dim wide, its value value_dim; the cache stores the
    expanded K and V with head_dim = max(nope_dim + rope_dim, value_dim), zero-padded
    (`models/latent_attention.py`). Kimi Linear rotates nothing (its layers' RopeSpec has rotary_dim 0)."""

    kv_rank: int
    q_rank: int
    nope_dim: int
    rope_dim: int
    value_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of the MoE layers (one spec shared by all of them)."""

    num_experts: int
    top_k: int
    expert_size: int  # intermediate width of one expert
    router: str  # "softmax" | "sigmoid"
    normalize_topk: bool
    routed_scaling: float = 1.0
    logit_softcap: float = 0.0  # 0: off; else logits = cap * tanh(logits / cap)
    correction_bias: bool = False  # sigmoid routers: a bias added to scores for selection only
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(h . shared_gate) (Qwen3-Next)
    float32_weights: bool = False  # weigh expert outputs in float32, then cast (Mixtral's reference does)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer, normalized across architectures."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    max_position_embeddings: int
    intermediate_size: int = 0  # dense MLP width (dense layers only)
    moe: MoESpec | None = None
    attention_bias: bool = False  # q, k, v (and o: `attention_output_bias`) projections add a bias
    attention_output_bias: bool = True  # with attention_bias: o's too (GLM-4.5's o_proj has none)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    # None | "head" | "element": softplus output gate from its own projection (Laguna);
    # "sigmoid": a per-element sigmoid gate whose rows sit in wq beside each head's query (Qwen3-Next)
    attention_gate: str | None = None
    linear_attention: LinearAttentionSpec | None = None  # the recurrent ("gdn", "kda") layers' shapes
    latent_attention: LatentAttentionSpec | None = None  # set: every full layer is MLA
    # RMSNorm multiplies by (norm_offset + weight): Qwen3-Next stores its norm weights around 0
    norm_offset: float = 0.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "hidden_size", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.layers:
            problems.append("the model has no layers")
        for i, layer in enumerate(self.layers):
            if layer.is_recurrent:
                if self.linear_attention is None:
                    problems.append(f"layer {i} is recurrent ('{layer.attention}') but there is no linear attention "
                                    "configuration")
                continue
            if layer.num_heads <= 0 or layer.num_heads % max(self.num_kv_heads, 1):
                problems.append(f"layer {i}: {layer.num_heads} query heads is not a multiple of "
                                f"{self.num_kv_heads} KV heads")
            if layer.is_sliding and (not isinstance(layer.window, int) or layer.window <= 0):
                problems.append(f"layer {i}: sliding window must be a positive integer, got {layer.window!r}")
            if self.latent_attention is not None:
                problems.extend(f"layer {i}: {p}" for p in self._latent_problems(layer))
            elif layer.rope.rotary_dim % 2 or not 0 < layer.rope.rotary_dim <= self.head_dim:
                problems.append(f"layer {i}: rotary dimension {layer.rope.rotary_dim} must be even and <= head_dim")
            if layer.mlp == "dense" and self.intermediate_size <= 0:
                problems.append(f"layer {i} is dense but intermediate_size is {self.intermediate_size}")
            if layer.mlp == "moe" and self.moe is None:
                problems.append(f"layer {i} is MoE but there is no expert configuration")
        if self.moe is not None and not 0 < self.moe.top_k <= self.moe.num_experts:
            problems.append(f"num_experts_per_tok {self.moe.top_k} must be in 1..{self.moe.num_experts}")
        lin = self.linear_attention
        if lin is not None and lin.value_heads % lin.key_heads:
            problems.append(f"linear_num_value_heads {lin.value_heads} is not a multiple of "
                            f"linear_num_key_heads {lin.key_heads}")
        if lin is not None and lin.projections not in ("grouped", "flat"):
            problems.append(f"linear attention projections must be 'grouped' or 'flat', got {lin.projections!r}")
        if problems:
            raise ConfigError("config.json: " + "; ".join(problems[:4]))

    def _latent_problems(self, layer: LayerSpec) -> list[str]:
        mla = self.latent_attention
        problems = []
        if layer.attention != "full" or layer.rope.rotary_dim != 0:
            problems.append("latent attention layers must be full attention without RoPE")
        if self.head_dim != max(mla.qk_dim, mla.value_dim) or self.num_kv_heads != layer.num_heads:
            problems.append("latent attention caches every head's K and V at head_dim = max(qk, v) dims")
        return problems

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def max_heads(self) -> int:
        return max(layer.num_heads for layer in self.layers)

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state instead of K/V rows (Gated DeltaNet, KDA)."""
        return any(layer.is_recurrent for layer in self.layers)

    @property
    def max_window(self) -> int | None:
        windows = [layer.window for layer in self.layers if layer.is_sliding]
        return max(windows) if windows else None

    def kv_bytes_per_token(self, dtype_bytes: int, int8: bool = False) -> int:
        """K and V of one token in one layer (every layer kind stores the same row); `int8`: as the
        paged pool stores them with kv_dtype="int8", a byte a value and a float32 scale per head."""
        if int8:
            return 2 * self.num_kv_heads * (self.head_dim + 4)
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes
