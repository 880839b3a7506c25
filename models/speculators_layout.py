"""The Speculators library's layout of DFlash-family drafters (`speculators_model_type` "dflash" or
"dspark"), read into and written from the z-lab layout `dflash.build_config` parses.

Facts of the layout (read from speculators 0.9.0):
- config.json: `speculators_model_type`, `architectures` (["DFlashSpeculator"] or
  ["DSparkSpeculator"]), `transformer_layer_config` (the drafter's own Qwen3-style decoder: sizes,
  layer_types, rope), `draft_vocab_size`, `block_size`, `mask_token_id`,
  `aux_hidden_state_layer_ids`, `sliding_window_non_causal`, `sample_from_anchor`,
  `speculators_config` (algorithm, proposal methods, verifier); DSpark adds `markov_rank`,
  `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`;
- `aux_hidden_state_layer_ids` index the target's hidden-states tuple, whose 0 is the embeddings:
  id i is lucebox's (and z-lab's) target layer i - 1;
- tensors carry z-lab's names (fc, hidden_norm, norm, layers.N.self_attn.q_proj, ...); a reduced
  draft vocabulary adds its own lm_head and the d2t/t2d maps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lucebox.models.dspark import HEAD_DEFAULTS, DSparkConfig

from lucebox.errors import DraftModelError

if TYPE_CHECKING:
    from lucebox.models.dflash import DFlashConfig

ARCHITECTURES = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}
# z-lab config keys that are not the decoder's (as Speculators' own converter splits them)
NOT_DECODER = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "dspark_config")


def is_speculators(hf: dict) -> bool:
    names = hf.get("architectures")
    return "speculators_model_type" in hf or (isinstance(names, list) and bool(names)
                                              and names[0] in ARCHITECTURES.values())


def _refuse_what_lucebox_cannot_run(hf: dict, kind: str, layer: dict) -> None:
    vocab = layer.get("vocab_size")
    if hf.get("draft_vocab_size") not in (None, vocab):
        raise DraftModelError(f"drafter config.json: draft_vocab_size {hf['draft_vocab_size']} differs from the "
                              f"vocabulary ({vocab}): reduced draft vocabularies (the d2t/t2d maps) are not "
                              "supported; use a drafter over the target's whole vocabulary")
    if hf.get("sample_from_anchor", kind == "dspark"):  # the public default is true for dspark
        raise DraftModelError("drafter config.json: sample_from_anchor true (the anchor row drafts too) is not "
                              "supported: lucebox drafts from the mask rows (block row j is the token j after the "
                              "anchor); use a drafter trained with sample_from_anchor false")
    if hf.get("sliding_window_non_causal") and "sliding_attention" in (layer.get("layer_types") or ()):
        raise DraftModelError("drafter config.json: sliding_window_non_causal is not supported (lucebox's sliding "
                              "drafter layers are causal inside the block)")


def from_speculators(hf: dict) -> dict:
    """The z-lab-layout config (with a `dspark_config` holding the heads' keys) of a Speculators-layout
    one; what lucebox cannot run is a DraftModelError naming the key."""
    kind = hf.get("speculators_model_type")
    if kind not in ARCHITECTURES:
        raise DraftModelError(f"drafter config.json: speculators_model_type {kind!r} is not a DFlash-family drafter "
                              f"({', '.join(ARCHITECTURES)})")
    layer = hf.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftModelError("drafter config.json has no transformer_layer_config object (the drafter's layers)")
    ids = hf.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftModelError("drafter config.json: aux_hidden_state_layer_ids must be a list of target layer ids")
    if min(ids) < 1:
        raise DraftModelError(f"drafter config.json: aux_hidden_state_layer_ids {ids} reads id 0 (the target's "
                              "embeddings), which lucebox does not capture; ids must be 1 or more")
    _refuse_what_lucebox_cannot_run(hf, kind, layer)
    out = {**layer, "architectures": ["DFlashDraftModel"],
           "dflash_config": {"target_layer_ids": [i - 1 for i in ids], "mask_token_id": hf.get("mask_token_id"),
                             "block_size": hf.get("block_size", 8)}}
    if kind == "dspark":
        out["dspark_config"] = {key: hf.get(key, default) for key, default in HEAD_DEFAULTS.items()}
    return out


def to_speculators(zlab: dict, cfg: DFlashConfig, heads: DSparkConfig | None, verifier: dict) -> dict:
    """The Speculators-layout config of a z-lab-layout drafter config `zlab` (`cfg`: what it builds),
    with DSpark `heads` (type "dspark") or none ("dflash"); `verifier`: name_or_path and architectures."""
    if cfg.laguna or cfg.gate or cfg.causal:
        raise DraftModelError("a Laguna-variant or block-causal DFlash drafter has no Speculators layout (gates, "
                              "per-layer feature norms and causal full-attention blocks are not part of it); "
                              "DSpark heads need a DFlashDraftModel-style drafter")
    if (cfg.output_multiplier, cfg.logit_softcap, cfg.embedding_scale) != (1.0, 0.0, 1.0):
        raise DraftModelError("a drafter with output_multiplier, final_logit_softcapping or input_embedding_scale "
                              "has no Speculators layout")
    kind = "dflash" if heads is None else "dspark"
    out = {
        "speculators_model_type": kind, "architectures": [ARCHITECTURES[kind]],
        "transformer_layer_config": {k: v for k, v in zlab.items() if k not in NOT_DECODER},
        "draft_vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "sliding_window_non_causal": False, "sample_from_anchor": False,
        "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy", "verifier": verifier,
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": cfg.block_size - 1}]},
    }
    if heads is not None:
        out.update(markov_rank=heads.markov_rank, markov_head_type="vanilla",
                   enable_confidence_head=heads.confidence, confidence_head_with_markov=heads.confidence_with_markov)
    return out
