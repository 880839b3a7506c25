"""Qwen3.5 (dense, text): Qwen3-Next's hybrid of Gated DeltaNet and gated full attention
(`models/qwen3_next.py`), with a dense MLP in every layer and the GDN input projections stored
separately (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: the "flat" row order of
`models/gated_deltanet.py`). Its RoPE is multimodal (mrope): t, h and w positions each rotate their
own share of the frequencies. For text every token's three positions are equal, so mrope is plain
RoPE, which is all lucebox runs: the multimodal checkpoints (ForConditionalGeneration, with a
vision tower) are refused."""

from __future__ import annotations

from lucebox.models.hf_config import integer, require, rope_parameters
from lucebox.models.layout import hf_sources
from lucebox.models.qwen3_next import gdn_sources, hybrid_config
from lucebox.models.sources import Cat, Source

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError, UnsupportedArchitectureError

ARCHITECTURES = ("Qwen3_5ForCausalLM",)
REFUSED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration",)  # `refuse_vision_checkpoint`


def refuse_vision_checkpoint(hf: dict) -> None:
    """The image-text checkpoints nest the text model's config under `text_config` and hold a vision
    tower (model.visual.*) that lucebox cannot run yet: say so, and how to get a text-only one."""
    name = hf.get("architectures", ["?"])[0]
    if name.endswith("ForConditionalGeneration") or "text_config" in hf or "vision_config" in hf:
        text = name.replace("ForConditionalGeneration", "ForCausalLM")
        raise UnsupportedArchitectureError(
            f"{name} is an image-text checkpoint; its vision tower is not supported yet. Use a text-only "
            f"checkpoint: config.json with architectures [\"{text}\"] and the fields of text_config at the top "
            "level, weights under model.* (not model.language_model.*) and no model.visual.* tensors")


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
    refuse_vision_checkpoint(hf)
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
    return {**hf_sources(cfg), **gdn_sources(cfg, flat_projections(cfg))}
