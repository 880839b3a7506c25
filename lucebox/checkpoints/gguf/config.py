"""GGUF metadata -> the Hugging Face config.json dict the architecture adapters already read.

Translating into config.json form (rather than building a `ModelConfig` directly) keeps one
adapter per architecture: a GGUF model gets exactly the `ModelConfig` its Hugging Face original
gets. Keys follow llama.cpp (`{arch}.block_count`, `{arch}.attention.head_count`, ...).

llama.cpp writes Llama, Mistral and Mixtral all as architecture `llama`: experts make it Mixtral,
a sliding window Mistral. Laguna's keys are those of llama.cpp's LLM_ARCH_LAGUNA (per-layer head
counts, `leading_dense_block_count`, `attention.sliding_window_pattern`, `rope.*_swa`); its router
soft-cap, which llama.cpp does not implement, is read from `laguna.router_logit_softcapping`, the
key gguf-py defines for that purpose. The Gated DeltaNet hybrids' keys: `hybrid_config`; GLM-4.5's:
`glm_config`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lucebox.checkpoints.gguf import glm_config, hybrid_config, kimi_config
from lucebox.errors import ConfigError, TokenizerError, UnsupportedArchitectureError
from lucebox.models.hf_config import check_values

SUPPORTED_GGUF_ARCHITECTURES = ("glm4moe", "kimi-linear", "laguna", "llama", "qwen3", "qwen3moe", "qwen3next",
                                "qwen35", "qwen35moe")


# config.json fields read straight from `{arch}.<key>`, to name the key when a field is refused
_FIELDS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count",
           "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
           "head_dim": "attention.key_length", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
           "max_position_embeddings": "context_length", "intermediate_size": "feed_forward_length",
           "linear_num_key_heads": "ssm.group_count", "linear_num_value_heads": "ssm.time_step_rank",
           "linear_key_head_dim": "ssm.state_size", "linear_conv_kernel_dim": "ssm.conv_kernel",
           **kimi_config.FIELDS}


@contextmanager
def in_gguf_terms(source: Path, arch: str) -> Iterator[None]:
    """A ConfigError of the checks every config.json goes through (the one range check the
    safetensors path uses too), restated for the GGUF file it was translated from."""
    try:
        yield
    except ConfigError as e:
        why = str(e).removeprefix("config.json: ")
        field = next((f for f in _FIELDS if re.search(rf"\b{f}\b", why)), None)
        key = f" (from GGUF key '{arch}.{_FIELDS[field]}')" if field else ""
        raise type(e)(f"{source.name}: its metadata, read as config.json, is refused: {why}{key}") from None


class _Metadata:
    """Typed access to `{arch}.*` keys, with errors that name the key and the file."""

    def __init__(self, metadata: dict, arch: str, source: Path):
        self.metadata, self.arch, self.source = metadata, arch, source

    def get(self, suffix: str, default=None):
        value = self.metadata.get(f"{self.arch}.{suffix}")
        return default if value is None else value

    def require(self, suffix: str):
        value = self.get(suffix)
        if value is None:
            raise ConfigError(f"{self.source.name}: GGUF metadata lacks '{self.arch}.{suffix}', "
                              f"which {self.arch} needs")
        return value

    def uniform(self, suffix: str, default=None):
        """A per-model value that llama.cpp may also write as a per-layer array (all equal here)."""
        value = self.get(suffix, default) if default is not None else self.require(suffix)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise ConfigError(f"{self.source.name}: '{self.arch}.{suffix}' varies by layer ({value[:8]}), "
                                  f"which lucebox supports only for laguna head counts")
            value = value[0]
        return value


def _token_ids(metadata: dict) -> dict:
    stop = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return {"bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": [i for i in dict.fromkeys(stop) if i is not None] or None}


def _rope(meta: _Metadata, head_dim: int, dimension_key: str = "rope.dimension_count",
          base_key: str = "rope.freq_base", scaled: bool = True) -> dict:
    """A `rope_parameters` dict: base, partial rotary, and llama.cpp's rope.scaling.* (linear, yarn)."""
    rotary = int(meta.get(dimension_key, head_dim))
    params = {"rope_type": "default", "rope_theta": float(meta.get(base_key, meta.get("rope.freq_base", 10000.0)))}
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    kind = meta.get("rope.scaling.type", "none") if scaled else "none"
    if kind in ("linear", "yarn"):
        params.update(rope_type=kind, factor=float(meta.require("rope.scaling.factor")))
        if meta.get("rope.scaling.original_context_length") is not None:
            params["original_max_position_embeddings"] = int(meta.get("rope.scaling.original_context_length"))
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if meta.get(f"rope.scaling.{theirs}") is not None:
                params[ours] = float(meta.get(f"rope.scaling.{theirs}"))
    elif kind != "none":
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.rope.scaling.type' is '{kind}', which lucebox "
                          "does not support (none, linear, yarn)")
    return params


def _common(meta: _Metadata, vocab_size: int, tied: bool) -> dict:
    sizes = _model_sizes(meta, vocab_size)
    heads = sizes["num_attention_heads"]
    sizes.update(num_key_value_heads=meta.uniform("attention.head_count_kv", heads),
                 head_dim=meta.get("attention.key_length"))
    with in_gguf_terms(meta.source, meta.arch):
        check_values(sizes)  # every size in range before any is divided by
        head_dim = int(sizes["head_dim"] or sizes["hidden_size"] // sizes["num_attention_heads"])
        check_values({"head_dim": head_dim})
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.attention.value_length' differs from key_length; "
                          "lucebox needs equal key and value head sizes")
    return {**_plain(sizes, tied, meta), "head_dim": head_dim, "rope_parameters": _rope(meta, head_dim)}


def _model_sizes(meta: _Metadata, vocab_size: int) -> dict:
    """The sizes every architecture has, as config.json names them (attention's own aside)."""
    heads = meta.require("attention.head_count")
    return {"vocab_size": vocab_size, "hidden_size": meta.require("embedding_length"),
            "num_hidden_layers": meta.require("block_count"),
            "num_attention_heads": heads[0] if isinstance(heads, list) and heads else heads,
            "max_position_embeddings": meta.get("context_length", 4096),
            "intermediate_size": meta.uniform("feed_forward_length", 0),
            "rms_norm_eps": meta.require("attention.layer_norm_rms_epsilon")}


def _plain(sizes: dict, tied: bool, meta: _Metadata) -> dict:
    return {**{key: int(value) for key, value in sizes.items() if key != "rms_norm_eps"},
            "rms_norm_eps": float(sizes["rms_norm_eps"]), "tie_word_embeddings": tied, **_token_ids(meta.metadata)}


def _kimi_linear(meta: _Metadata, vocab_size: int, tied: bool) -> dict:
    """Kimi Linear's common part: its attention sizes are MLA's and KDA's (`kimi_config`), and its
    head_count_kv (one per layer) tells the layer kinds."""
    sizes = _model_sizes(meta, vocab_size)
    with in_gguf_terms(meta.source, meta.arch):
        check_values(sizes)
    return kimi_config.kimi_linear(meta, _plain(sizes, tied, meta))


def _llama(meta: _Metadata, hf: dict, has: Callable[[str], bool], shape) -> dict:
    experts = int(meta.get("expert_count", 0))
    window = meta.get("attention.sliding_window")
    if experts:
        hf.update(architectures=["MixtralForCausalLM"], num_local_experts=experts,
                  num_experts_per_tok=int(meta.require("expert_used_count")), sliding_window=window)
        if meta.get("expert_feed_forward_length"):
            hf["intermediate_size"] = int(meta.get("expert_feed_forward_length"))
    elif window:
        hf.update(architectures=["MistralForCausalLM"], sliding_window=int(window))
    else:
        hf.update(architectures=["LlamaForCausalLM"], attention_bias=has("blk.0.attn_q.bias"))
    return hf


def _qwen3(meta: _Metadata, hf: dict, has, shape) -> dict:
    hf.update(architectures=["Qwen3ForCausalLM"], use_sliding_window=False)
    return hf


def _qwen3moe(meta: _Metadata, hf: dict, has, shape) -> dict:
    n = hf["num_hidden_layers"]
    hf.update(architectures=["Qwen3MoeForCausalLM"], use_sliding_window=False,
              num_experts=int(meta.require("expert_count")), num_experts_per_tok=int(meta.require("expert_used_count")),
              moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
              norm_topk_prob=bool(meta.get("expert_weights_norm", True)),
              # llama.cpp makes every qwen3moe layer MoE; a layer without a router is dense here.
              mlp_only_layers=[i for i in range(n) if not has(f"blk.{i}.ffn_gate_inp.weight")])
    return hf


def _laguna_layer_types(meta: _Metadata, n: int) -> list[str]:
    """Which layers slide: llama.cpp's sliding_window_pattern (a period, full attention where
    il % period == 0, 4 by default; or one bool per layer), or attention.layer_types strings."""
    if not meta.get("attention.sliding_window"):
        return ["full_attention"] * n
    named = meta.get("attention.layer_types")
    if isinstance(named, list):
        return list(named)
    pattern = meta.get("attention.sliding_window_pattern", 4)
    if not isinstance(pattern, list) and int(pattern) < 1:
        raise ConfigError(f"{meta.source.name}: 'laguna.attention.sliding_window_pattern' is {pattern}; a period "
                          "of layers must be at least 1")
    sliding = pattern if isinstance(pattern, list) else [i % int(pattern) != 0 for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _laguna(meta: _Metadata, hf: dict, has, shape) -> dict:
    n, head_dim = hf["num_hidden_layers"], hf["head_dim"]
    heads = meta.require("attention.head_count")
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * n
    if not meta.get("expert_weights_norm", True):
        raise ConfigError(f"{meta.source.name}: 'laguna.expert_weights_norm' is false; lucebox's Laguna always "
                          "normalizes the chosen experts' weights")
    if meta.get("expert_gating_func", kimi_config.SIGMOID_GATING) != kimi_config.SIGMOID_GATING:
        raise ConfigError(f"{meta.source.name}: 'laguna.expert_gating_func' is {meta.get('expert_gating_func')}; "
                          f"lucebox's Laguna routes with a sigmoid ({kimi_config.SIGMOID_GATING})")
    gate_rows = shape("blk.0.attn_gate.weight")[0] if has("blk.0.attn_gate.weight") else None
    gating = {None: False, heads[0]: "per-head", heads[0] * head_dim: "per-element"}.get(gate_rows)
    if gating is None:
        raise ConfigError(f"{meta.source.name}: blk.0.attn_gate.weight has {gate_rows} rows, neither one per head "
                          f"({heads[0]}) nor one per element ({heads[0] * head_dim})")
    dense = int(meta.get("leading_dense_block_count", 0))
    full_rope = _rope(meta, head_dim)
    sliding_rope = _rope(meta, head_dim, "rope.dimension_count_swa", "rope.freq_base_swa", scaled=False)
    hf.update(
        architectures=["LagunaForCausalLM"], num_attention_heads_per_layer=heads, gating=gating,
        layer_types=_laguna_layer_types(meta, n), sliding_window=meta.get("attention.sliding_window"),
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(n)],
        num_experts=int(meta.require("expert_count")), num_experts_per_tok=int(meta.require("expert_used_count")),
        moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(meta.get("expert_shared_feed_forward_length", 0)),
        moe_routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
        moe_router_logit_softcapping=float(meta.get("router_logit_softcapping", 0.0)),
        rope_parameters={"full_attention": full_rope, "sliding_attention": sliding_rope},
    )
    return hf


def _check_vocabulary(metadata: dict, rows: int, source: Path) -> None:
    """One token per embedding row, as llama.cpp requires: with more tokens the tokenizer makes ids
    the model has no row for; with fewer, ids the model generates would have no text."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != rows:
        raise TokenizerError(f"{source.name}: tokenizer.ggml.tokens holds {len(tokens)} tokens but token_embd.weight "
                             f"has {rows} rows; the tokenizer does not belong to this model (llama.cpp refuses "
                             "it too)")


_BUILDERS = {"llama": _llama, "qwen3": _qwen3, "qwen3moe": _qwen3moe, "laguna": _laguna,
             "qwen3next": hybrid_config.qwen3next, "qwen35": hybrid_config.qwen35,
             "qwen35moe": hybrid_config.qwen35moe, "glm4moe": glm_config.glm4moe}


def hf_config_from_gguf(metadata: dict, has: Callable[[str], bool], shape: Callable[[str], tuple[int, ...]],
                        source: Path) -> dict:
    """The config.json dict of the model a GGUF file holds; `has` and `shape` look at its tensors
    (tied embeddings, attention biases, dense layers and the gate width are told by them)."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source.name}: general.architecture is {arch!r}, which lucebox does not support "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")
    if not has("token_embd.weight"):
        raise ConfigError(f"{source.name}: the GGUF file has no token_embd.weight, so the vocabulary size is unknown")
    meta = _Metadata(metadata, arch, source)
    rows = shape("token_embd.weight")[0]
    _check_vocabulary(metadata, rows, source)
    try:
        if arch == "kimi-linear":
            return _kimi_linear(meta, rows, tied=not has("output.weight"))
        hf = _common(meta, rows, tied=not has("output.weight"))
        return _BUILDERS[arch](meta, hf, has, shape)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigError(f"{source.name}: GGUF metadata has a value of the wrong type ({e})") from None
