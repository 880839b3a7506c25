"""Qwen3.5 (dense, text): Qwen3-Next's hybrid of Gated DeltaNet and gated full attention
(`models/qwen3_next.py`), with a dense MLP in every layer and the GDN input projections stored
separately (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: the "flat" row order of
`models/gated_deltanet.py`). Its RoPE is multimodal (mrope): t, h and w positions each rotate their
own share of the frequencies. For text every token's three positions are equal, so mrope is plain
RoPE, which is all lucebox runs.

The published checkpoints are image-text ones (ForConditionalGeneration): config.json nests the
text model's fields under `text_config` beside a `vision_config`, and the weights are the text
model under model.language_model.*, the vision tower under model.visual.* and lm_head.weight.
lucebox loads their text model (`text_model_fields`, `sources`) and skips the vision tower by name
(`VISION_TOWER`), saying so; like Qwen3-Next's, the checkpoints' MTP head is skipped too."""

from __future__ import annotations

from lucebox.models.hf_config import integer, require, rope_parameters
from lucebox.models.layout import hf_sources
from lucebox.models.qwen3_next import MTP_HEAD, gdn_sources, hybrid_config
from lucebox.models.sources import Cat, Source, Unloaded, renamed

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
VISION_TOWER = Unloaded("model.visual.", "the vision tower (image and video input); lucebox runs the text model only")
UNLOADED = (MTP_HEAD, VISION_TOWER)  # transformers' Qwen3.5 ignores both prefixes on load too
# An image-text config.json's text_config lacks what the composite model states at the top level:
# its class, and tie_word_embeddings (transformers ties lm_head by the top-level value, default
# false); token ids and dtype are taken from the top level only where text_config has none.
_FROM_TOP_LEVEL = {"architectures": None, "tie_word_embeddings": False}
_INHERITED = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")
_TEXT_PREFIX = "model.language_model."  # where an image-text checkpoint keeps the text model's model.*


def is_image_text(architecture: str) -> bool:
    return architecture.endswith("ForConditionalGeneration")


def text_model_fields(hf: dict) -> dict:
    """The text model's config.json fields: an image-text config's `text_config` completed from
    its top level (a text-only config as it is)."""
    text = hf.get("text_config")
    if text is None:
        return hf
    if not isinstance(text, dict):
        raise ConfigError("config.json: text_config must be an object")
    inherited = {key: hf[key] for key in _INHERITED if key in hf}
    top = {key: hf.get(key, default) for key, default in _FROM_TOP_LEVEL.items()}
    return {**inherited, **text, **top}


def check_mrope(hf: dict) -> None:
    """mrope_section says how many frequencies the h and w positions take; with text positions all
    equal it changes nothing, but a malformed one is still an error, as it would be in transformers."""
    params = rope_parameters(hf)
    section = params.get("mrope_section")
    if section is not None:
        if not isinstance(section, list) or len(section) != 3:
            raise ConfigError(f"config.json: mrope_section must list 3 integers (t, h, w), got {str(section)[:40]!r}")
        for i, value in enumerate(section):
            integer(value, f"mrope_section[{i}]", 0, 4096)
    if not isinstance(params.get("mrope_interleaved", True), bool):
        raise ConfigError("config.json: mrope_interleaved must be true or false")


def build_config(hf: dict) -> ModelConfig:
    check_mrope(hf)
    n = integer(require(hf, "num_hidden_layers"), "num_hidden_layers", 1, 1024)
    integer(require(hf, "intermediate_size"), "intermediate_size", 1, 2**20)
    return hybrid_config(hf, ["dense"] * n, None, projections="flat")


def flat_projections(cfg: ModelConfig) -> dict[str, Source]:
    """gdn_qkvz = in_proj_qkv then in_proj_z, gdn_ba = in_proj_b then in_proj_a (relative names)."""
    s = cfg.linear_attention
    z_rows = s.value_heads * s.value_dim
    return {"qkvz": Cat(("in_proj_qkv.weight", "in_proj_z.weight"), (s.conv_channels, z_rows)),
            "ba": Cat(("in_proj_b.weight", "in_proj_a.weight"), (s.value_heads, s.value_heads))}


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """The text model's tensors; in an image-text checkpoint its model.* is under model.language_model.*
    (lm_head.weight stays at the top)."""
    text = {**hf_sources(cfg), **gdn_sources(cfg, flat_projections(cfg))}
    if not is_image_text(cfg.architecture):
        return text
    return {ours: renamed(source, _under_language_model) for ours, source in text.items()}


def _under_language_model(name: str) -> str:
    return _TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name
