"""Reading the fields of a Hugging Face config.json that several architectures share."""

from __future__ import annotations

from typing import Any

from lucebox.config import LayerSpec, MoESpec, RopeSpec
from lucebox.errors import ConfigError

_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def require(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        raise ConfigError(f"config.json has no '{key}', which {hf.get('architectures', ['this model'])[0]} needs")
    return hf[key]


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or require(hf, "hidden_size") // require(hf, "num_attention_heads")


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


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


def rope_spec(params: dict, dim: int, max_position_embeddings: int) -> RopeSpec:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in _ROPE_KINDS:
        raise ConfigError(f"config.json: rope_type '{kind}' is not supported (supported: {', '.join(_ROPE_KINDS)})")
    rotary_dim = int(dim * params.get("partial_rotary_factor", 1.0))
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if kind == "yarn" and factor is None:
        factor = max_position_embeddings / require(params, "original_max_position_embeddings")
    if kind in ("linear", "llama3", "yarn") and factor is None:
        raise ConfigError(f"config.json: rope_type '{kind}' needs 'factor'")
    return RopeSpec(
        theta=float(params.get("rope_theta", 10000.0)),
        rotary_dim=rotary_dim,
        kind=kind,
        factor=float(factor or 1.0),
        original_max_position=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
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
        raise ConfigError(f"config.json: hidden_act '{act}' is not supported (lucebox implements 'silu')")


def common_fields(hf: dict) -> dict:
    """Keyword arguments of ModelConfig that every supported architecture reads the same way."""
    check_activation(hf)
    return dict(
        architecture=hf["architectures"][0],
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
