"""Turning `LLM(draft=...)` into a proposer: None, "ngram", "auto", or a drafter folder (a DFlash
drafter, or a smaller model of a supported architecture sharing the target's vocabulary)."""

from __future__ import annotations

from pathlib import Path

import torch

from lucebox.checkpoint import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.config import ModelConfig
from lucebox.errors import DraftModelError
from lucebox.models import dflash
from lucebox.models.decoder import Decoder
from lucebox.speculative.dflash import DFlashProposer
from lucebox.speculative.draft_model import DraftModelProposer
from lucebox.speculative.ngram import NgramProposer
from lucebox.speculative.proposer import Proposer


def paired_drafter(model_folder: Path) -> Path | None:
    """A drafter shipped with the model: <model>/draft, <model>/dflash, or a sibling <model>-DFlash."""
    for candidate in (model_folder / "draft", model_folder / "dflash",
                      model_folder.parent / f"{model_folder.name}-DFlash"):
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _check_dflash(cfg: dflash.DFlashConfig, target: ModelConfig, folder: Path) -> None:
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != the target's {target.vocab_size}")
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != the target's {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} are not layers of the {target.num_layers}-layer target")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary")
    if cfg.block_size < 2:
        problems.append(f"block_size {cfg.block_size} leaves no room for drafts")
    if problems:
        raise DraftModelError(f"drafter {folder} does not fit this target: " + "; ".join(problems))


def make_proposer(draft: str | Path | None, llm, draft_ctx: int, max_width: int) -> Proposer | None:
    if draft is None:
        return None
    if draft == "ngram":
        return NgramProposer(max_width=max_width)
    if draft == "auto":
        draft = paired_drafter(llm.description.folder)
        if draft is None:
            return None
    config_path = locate_config(draft)
    hf = read_json(config_path)
    arch = (hf.get("architectures") or [None])[0]
    folder = config_path.parent
    if arch in dflash.ARCHITECTURES:
        cfg = dflash.build_config(hf)
        _check_dflash(cfg, llm.config, folder)
        weights = load_weights(CheckpointIndex(weight_files(folder)), dflash.sources(cfg), dflash.weight_shapes(cfg),
                               llm.dtype, llm.device)
        drafter = dflash.DFlashDrafter(cfg, weights, llm.decoder.kernels)
        proposer = DFlashProposer(drafter, llm.decoder, llm.prefill_chunk, draft_ctx)
        proposer.max_width = min(proposer.max_width, max_width)
        return proposer
    from lucebox.loading import describe_model, load_model  # a target-style model used as drafter

    desc = describe_model(folder)
    if desc.cfg.vocab_size != llm.config.vocab_size:
        raise DraftModelError(f"draft model {folder} has a vocabulary of {desc.cfg.vocab_size} tokens, the target "
                              f"{llm.config.vocab_size}; a draft model must share the target's vocabulary")
    decoder: Decoder = load_model(desc, llm.dtype, llm.device, kernels=llm.decoder.kernels).decoder
    return DraftModelProposer(decoder, llm.max_context, llm.prefill_chunk, draft_ctx, max_width)


def measure_verify_seconds(llm, widths=(1, 2, 4, 8, 16)) -> dict[int, float]:
    """Seconds of one target forward of each width, on a scratch cache (the start-up cost model)."""

    from lucebox.caches import Step

    cache = llm._new_cache()
    # Distinct tokens, so MoE rows spread over experts as real ones do (identical rows share two).
    ids = torch.arange(max(widths) + 8, dtype=torch.long, device=llm.device) * 7919 % llm.config.vocab_size
    llm.decoder.forward(ids[:8], Step(torch.arange(8, device=llm.device), prefill=True), cache)
    cache.commit(8)
    seconds = {}
    for w in widths:
        best = float("inf")
        for _ in range(2):
            start = llm._clock()
            llm.decoder.forward(ids[:w], Step(torch.arange(8, 8 + w, device=llm.device)), cache)
            best = min(best, llm._clock() - start)
            cache.rollback(8)
        seconds[w] = best
    return seconds
