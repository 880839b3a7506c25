"""Reading the fields of a Hugging Face config.json that several architectures share."""

from __future__ import annotations

import math
from typing import Any

from lucebox.config import LayerSpec, MoESpec, RopeSpec
from lucebox.errors import ConfigError

_ROPE_KINDS = ("default", "linear", "llama3", "yarn")

# Every size config.json may state, with the range lucebox accepts. They are checked before
# anything is built from them: a layer count of 10**7 must fail at once, not after minutes of
# building layers and gigabytes of plans. The upper bounds are far beyond any released model.
_SIZES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**22),
    "hidden_size": (1, 2**17),
    "intermediate_size": (0, 2**20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 4096),
    "num_key_value_heads": (1, 4096),
    "head_dim": (1, 4096),
    "max_position_embeddings": (1, 2**26),
    "original_max_position_embeddings": (1, 2**26),
    "sliding_window": (0, 2**26),
    "num_experts": (0, 4096),
    "num_local_experts": (0, 4096),
    "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 2**20),
    "shared_expert_intermediate_size": (0, 2**20),
    "max_window_layers": (0, 2**20),
    "decoder_sparse_step": (0, 1024),
    "linear_num_key_heads": (1, 4096),
    "linear_num_value_heads": (1, 4096),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "full_attention_interval": (1, 1024),
    # Kimi Linear (DeepSeek-style MLA and MoE, KDA), under the names its config.json stores
    "kv_lora_rank": (1, 2**16),
    "q_lora_rank": (1, 2**16),
    "qk_nope_head_dim": (0, 4096),
    "qk_rope_head_dim": (0, 4096),
    "v_head_dim": (1, 4096),
    "linear_num_heads": (1, 4096),
    "linear_head_dim": (1, 4096),
    "num_expert_group": (1, 4096),
    "topk_group": (1, 4096),
    "num_shared_experts": (0, 64),
    "first_k_dense_replace": (0, 1024),
    "moe_layer_freq": (1, 1024),
    "model_max_length": (1, 2**26),
    "num_experts_per_token": (1, 4096),
}
_PER_LAYER_SIZES = {"num_attention_heads_per_layer": (1, 4096), "mlp_only_layers": (0, 1024)}


def shown(value: Any) -> str:
    """A value from config.json as a message quotes it: at most 40 characters of it."""
    return repr(str(value)[:40])


def integer(value: Any, what: str, lowest: int, highest: int) -> int:
    """`value` as an int in lowest..highest, or a ConfigError naming `what`: no bools, no fractions
    truncated (an integral float such as 4096.0 is accepted as the integer it is)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: {what} has the wrong type: it must be an integer, got {shown(value)}")
    if not lowest <= value <= highest:
        raise ConfigError(f"config.json: {what} must be in {lowest}..{highest}, got {value}")
    return value


def number(value: Any, what: str, positive: bool = False) -> float:
    """`value` as a finite float (> 0 with `positive`), or a ConfigError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config.json: {what} has the wrong type: it must be a finite number, "
                          f"got {shown(value)}")
    if positive and value <= 0:
        raise ConfigError(f"config.json: {what} must be > 0, got {value}")
    return float(value)


def check_values(hf: dict) -> None:
    """Type and range of every size and of the numbers the forward divides by or exponentiates
    (RMSNorm epsilon, RoPE base), before anything is built or allocated from them."""
    for key, (lowest, highest) in _SIZES.items():
        if hf.get(key) is not None:
            integer(hf[key], key, lowest, highest)
    for key, (lowest, highest) in _PER_LAYER_SIZES.items():
        values = hf.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or len(values) > 1024:
            raise ConfigError(f"config.json: {key} must be a list of at most 1024 integers")
        for i, v in enumerate(values):
            integer(v, f"{key}[{i}]", lowest, highest)
    for key in ("rms_norm_eps", "rope_theta"):  # rope_theta also where rope_parameters overrides it
        if hf.get(key) is not None:
            number(hf[key], key, positive=True)
    for key in ("eos_token_id", "bos_token_id"):
        ids = hf.get(key)
        for v in ids if isinstance(ids, list) else [ids]:
            if v is not None:
                integer(v, key, 0, 2**31 - 1)


def architecture_name(hf: dict) -> str:
    """The model class config.json names first in `architectures` ("LlamaForCausalLM")."""
    names = hf.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise ConfigError("config.json has no 'architectures' list naming the model class (such as "
                          f"[\"LlamaForCausalLM\"]), so the model type is unknown; it holds {str(names)[:60]!r}")
    return names[0]


def require(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json has no '{key}', which {architecture_name(hf)} needs")
    return hf[key]


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or require(hf, "hidden_size") // require(hf, "num_attention_heads")


def token_ids(value: Any) -> tuple[int, ...]:
    """Token ids stated as an int, a list of ints or null; anything else is left out."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def rope_parameters(hf: dict, params: dict | None = None) -> dict:
    """RoPE settings in the current `rope_parameters` form, completed from top-level fields the way
    transformers does (rope_theta, partial_rotary_factor, original_max_position_embeddings), and
    also read from the older rope_theta + rope_scaling form."""
    if params is None:
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else hf.get("rope_scaling")
    params = dict(params or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params.setdefault("original_max_position_embeddings",
                      hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"))
    return params


def _rope_number(params: dict, key: str, default: float | None, positive: bool = True) -> float | None:
    """params[key] checked as a finite number (> 0 with `positive`); `default` when absent or null."""
    value = params.get(key)
    return default if value is None else number(value, key, positive)


def _rope_factor(params: dict, kind: str, max_position_embeddings: int, original: int | None) -> float:
    """The scaling factor, checked: yarn may derive it from the context lengths; default has none."""
    if kind == "default":
        return 1.0  # no scaling: a factor stated beside it is unused, as in transformers
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original is not None:
        factor = max_position_embeddings / original
    if factor is None:
        needs = "'factor' (or 'original_max_position_embeddings')" if kind == "yarn" else "'factor'"
        raise ConfigError(f"config.json: rope_type '{kind}' needs {needs}")
    return number(factor, "rope factor", positive=True)  # 0 is refused, never read as "no scaling"


def rope_spec(params: dict, dim: int, max_position_embeddings: int) -> RopeSpec:
    """One layer kind's RoPE. Each value is checked as it is read, before anything is computed from
    it: a list or a string times the head size would repeat itself, not fail."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ConfigError(f"config.json: rope_type {shown(kind)} is not supported (supported: "
                          f"{', '.join(_ROPE_KINDS)})")
    fraction = _rope_number(params, "partial_rotary_factor", 1.0)
    if fraction > 1:
        raise ConfigError(f"config.json: partial_rotary_factor must be in (0, 1], got {fraction}")
    original = params.get("original_max_position_embeddings")
    if original is not None:  # before it divides
        original = integer(original, "original_max_position_embeddings", 1, 2**26)
    low, high = _rope_number(params, "low_freq_factor", 1.0), _rope_number(params, "high_freq_factor", 4.0)
    if kind == "llama3" and not high > low:
        raise ConfigError("config.json: llama3 RoPE needs high_freq_factor > low_freq_factor")
    return RopeSpec(
        theta=_rope_number(params, "rope_theta", 10000.0),
        rotary_dim=int(dim * fraction),
        kind=kind,
        factor=_rope_factor(params, kind, max_position_embeddings, original),
        original_max_position=original,
        low_freq_factor=low,
        high_freq_factor=high,
        beta_fast=_rope_number(params, "beta_fast", 32.0),
        beta_slow=_rope_number(params, "beta_slow", 1.0),
        attention_factor=_rope_number(params, "attention_factor", None, positive=False),
        mscale=_rope_number(params, "mscale", None, positive=False),
        mscale_all_dim=_rope_number(params, "mscale_all_dim", None, positive=False),
        truncate=bool(params.get("truncate", True)),
    )


def uniform_layers(hf: dict, windows: list[int | None], mlp_kinds: list[str]) -> tuple[LayerSpec, ...]:
    """Layers that share one RoPE and one head count; `windows[i]` None means full attention."""
    rope = rope_spec(rope_parameters(hf), head_dim(hf), hf.get("max_position_embeddings", 4096))
    heads = require(hf, "num_attention_heads")
    pairs = zip(windows, mlp_kinds, strict=True)
    return tuple(LayerSpec("sliding" if w else "full", heads, rope, mlp, window=w) for w, mlp in pairs)


def softmax_moe(hf: dict, num_experts_keys: tuple[str, ...], normalize: bool) -> MoESpec:
    num_experts = next((hf[k] for k in num_experts_keys if hf.get(k)), None)
    if num_experts is None:
        raise ConfigError(f"config.json has none of {', '.join(num_experts_keys)} (the expert count)")
    return MoESpec(
        num_experts=int(num_experts),
        top_k=int(require(hf, "num_experts_per_tok")),
        expert_size=int(hf.get("moe_intermediate_size") or require(hf, "intermediate_size")),
        router="softmax",
        normalize_topk=normalize,
    )


def check_activation(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {shown(act)} is not supported (lucebox implements 'silu')")


def common_fields(hf: dict) -> dict:
    """Keyword arguments of ModelConfig that every supported architecture reads the same way."""
    check_activation(hf)
    return dict(
        architecture=architecture_name(hf),
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=int(require(hf, "hidden_size")),
        num_kv_heads=int(hf.get("num_key_value_heads") or require(hf, "num_attention_heads")),
        head_dim=int(head_dim(hf)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        intermediate_size=int(hf.get("intermediate_size") or 0),
        attention_bias=bool(hf.get("attention_bias", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        checkpoint_dtype=hf.get("torch_dtype") or hf.get("dtype"),
    )


def field(hf: dict, names: tuple[str, ...], default=None):
    """The first of `names` config.json states (a field stored under either of its two names)."""
    return next((hf[name] for name in names if hf.get(name) is not None), default)


def sigmoid_moe(hf: dict, experts: tuple[str, ...] = ("num_experts", "num_local_experts"),
                scaling: float = 2.446) -> MoESpec:
    """DeepSeek-V3-style routed experts (Kimi Linear's, GLM-4.5's): a sigmoid router whose correction
    bias steers selection only, renormalized top-k weights times routed_scaling_factor (`scaling`
    when config.json has none), ungated shared experts. `experts`: the names of the expert count."""
    count = integer(field(hf, experts, 256), experts[0], 1, 4096)
    groups = integer(field(hf, ("num_expert_group", "n_group"), 1), "num_expert_group", 1, 4096)
    chosen_groups = integer(field(hf, ("topk_group",), 1), "topk_group", 1, 4096)
    if count % groups or chosen_groups != groups:
        raise ConfigError(f"config.json: grouped top-k routing (topk_group {chosen_groups} of num_expert_group "
                          f"{groups} over {count} experts) is not implemented: lucebox routes over all experts, "
                          "which needs topk_group == num_expert_group dividing num_experts")
    activation = hf.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise ConfigError(f"config.json: moe_router_activation_func {shown(activation)} is not supported "
                          "(this router is 'sigmoid')")
    if integer(hf.get("moe_layer_freq", 1), "moe_layer_freq", 1, 1024) != 1:
        raise ConfigError("config.json: moe_layer_freq other than 1 is not supported (transformers reads MoE "
                          "layers from first_k_dense_replace alone)")
    renormalize = field(hf, ("moe_renormalize", "norm_topk_prob"), True)
    if not isinstance(renormalize, bool):
        raise ConfigError(f"config.json: moe_renormalize must be true or false, got {shown(renormalize)}")
    width = integer(require(hf, "moe_intermediate_size"), "moe_intermediate_size", 1, 2**20)
    shared = integer(field(hf, ("num_shared_experts", "n_shared_experts"), 1), "num_shared_experts", 0, 64)
    return MoESpec(
        num_experts=count,
        top_k=integer(field(hf, ("num_experts_per_token", "num_experts_per_tok"), 8), "num_experts_per_token", 1,
                      count),
        expert_size=width, router="sigmoid", normalize_topk=renormalize,
        routed_scaling=number(hf.get("routed_scaling_factor", scaling), "routed_scaling_factor", positive=True),
        correction_bias=True, shared_expert_size=shared * width,
    )
