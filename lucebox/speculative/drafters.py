"""Turning `LLM(draft=...)` into a proposer: None, "ngram", "mtp" (the model's own MTP head),
"auto", or a drafter folder (a DFlash drafter, or a smaller model of a supported architecture
sharing the target's vocabulary)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.checkpoints.gguf.file import GGUFFile, locate_gguf
from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.checkpoints.loading import ModelDescription, describe_model, load_model
from lucebox.config import ModelConfig
from lucebox.device import DeviceClock
from lucebox.errors import DraftModelError
from lucebox.kernels.quant import quantized_bytes
from lucebox.limits import DECODE_ROWS
from lucebox.memory.plan import DrafterCost, cache_ring_bytes, ring_bytes, weight_bytes
from lucebox.models import dflash, mtp
from lucebox.models.decoder import Decoder
from lucebox.models.hf_config import architecture_name
from lucebox.models.layout import quantizable
from lucebox.speculative.dflash import DFlashProposer, ring_step
from lucebox.speculative.draft_model import DraftModelProposer, draft_cache_settings
from lucebox.speculative.drafter_spec import DrafterSpec
from lucebox.speculative.mtp import MTPProposer
from lucebox.speculative.mtp_source import mtp_drafter, mtp_file, mtp_weights, own_mtp, separate_mtp
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


def resolve_drafter(draft: str | Path | None, target: ModelDescription,
                    quantization: str | None = None) -> DrafterSpec | None:
    """The drafter `draft` names, checked against the target (vocabulary, shapes, captured layers,
    weight files present) before either is loaded; None for no drafter. An MTP head's linear layers
    take the target's `quantization`."""
    spec = _resolved(draft, target)
    if spec is not None and spec.kind == "mtp" and spec.head_file is None and spec.folder is not None:
        spec = dataclasses.replace(spec, quantization=quantization)
    return spec


def _resolved(draft: str | Path | None, target: ModelDescription) -> DrafterSpec | None:
    if draft is None:
        return None
    if draft == "ngram":
        return DrafterSpec("ngram")
    if draft == "mtp":
        return own_mtp(target)
    if draft == "auto":  # a drafter shipped beside the model, else the model's own MTP head
        draft = paired_drafter(target.folder)
        if draft is None:
            return mtp_drafter(target)
    head_file = locate_gguf(draft)
    if head_file is not None:
        return mtp_file(GGUFFile(head_file), target)
    config_path = locate_config(draft)
    hf = read_json(config_path)
    arch = architecture_name(hf)
    folder = config_path.parent
    index = CheckpointIndex(weight_files(folder))  # a drafter without weights says so before any memory figure
    if hf.get("speculators_model_type") == "mtp":  # the Speculators library's MTP layout
        return separate_mtp(hf.get("transformer_layer_config"), folder, target, "speculators")
    if "mtp.fc.weight" in index and not any(name.startswith("model.") for name in index.location):
        return separate_mtp(hf.get("text_config", hf), folder, target)
    if arch in dflash.ARCHITECTURES:
        cfg = dflash.build_config(hf)
        _check_dflash(cfg, target.cfg, folder)
        return DrafterSpec("dflash", folder, dflash=cfg)
    desc = describe_model(folder)  # a target-style model used as drafter
    if desc.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftModelError(f"draft model {folder} has a vocabulary of {desc.cfg.vocab_size} tokens, the target "
                              f"{target.cfg.vocab_size}; a draft model must share the target's vocabulary")
    return DrafterSpec("model", folder, model=desc)


def drafter_cost(spec: DrafterSpec | None, dtype: torch.dtype, max_context: int, prefill_chunk: int,
                 draft_ctx: int, max_width: int) -> DrafterCost:
    """The device bytes `make_proposer(spec, ...)` with these arguments will hold once it has drafted."""
    if spec is None or spec.kind == "ngram":
        return DrafterCost()
    if spec.kind == "dflash":
        cfg = spec.dflash
        row = 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        weights = sum(math.prod(shape) for shape in dflash.weight_shapes(cfg).values()) * dtype.itemsize
        rings = cfg.num_layers * ring_bytes(draft_ctx, ring_step(cfg, prefill_chunk), row)
        return DrafterCost(weights, rings, cfg.num_layers * (row + 8), draft_ctx)
    if spec.kind == "mtp":
        cfg, q = spec.head, spec.quantization
        weights = sum(quantized_bytes(shape, q) if q and quantizable(name) else math.prod(shape) * dtype.itemsize
                      for name, shape in mtp.head_shapes(cfg).items())
    else:
        cfg = spec.model.cfg
        weights = weight_bytes(cfg, dtype)
    full = sum(1 for layer in cfg.layers if not layer.is_sliding)
    rings = cache_ring_bytes(cfg, draft_cache_settings(max_context, prefill_chunk, draft_ctx, max_width), dtype)
    return DrafterCost(weights, rings, full * (cfg.kv_bytes_per_token(dtype.itemsize) + 8), draft_ctx)


def make_proposer(spec: DrafterSpec | None, target: Decoder, max_context: int, prefill_chunk: int, draft_ctx: int,
                  max_width: int) -> Proposer | None:
    """The proposer `spec` describes, its weights loaded next to the `target`'s (same dtype,
    device and kernels)."""
    if spec is None:
        return None
    if spec.kind == "ngram":
        return NgramProposer(max_width=max_width)
    if spec.kind == "dflash":
        cfg = spec.dflash
        weights = load_weights(CheckpointIndex(weight_files(spec.folder)), dflash.sources(cfg),
                               dflash.weight_shapes(cfg), target.dtype, target.device)
        drafter = dflash.DFlashDrafter(cfg, weights, target.kernels)
        proposer = DFlashProposer(drafter, target, prefill_chunk, draft_ctx)
        proposer.max_width = min(proposer.max_width, max_width)
        return proposer
    if spec.kind == "mtp":
        head = mtp.MTPHead(spec.head, mtp_weights(spec, target.dtype, target.device), target)
        return MTPProposer(head, target, max_context, prefill_chunk, draft_ctx, max_width)
    decoder: Decoder = load_model(spec.model, target.dtype, target.device, kernels=target.kernels).decoder
    return DraftModelProposer(decoder, max_context, prefill_chunk, draft_ctx, max_width)


def measure_verify_seconds(runner, cache: SequenceCache, clock: DeviceClock, feature_layers: tuple = (),
                           widths=(1, 2, 4, 8, DECODE_ROWS)) -> dict[int, float]:
    """Seconds of one target step of each width through `runner`, on an empty `cache` (the
    start-up cost model), keeping `feature_layers` as the requests' steps do (their graphs)."""
    decoder = runner.decoder
    device = decoder.device
    # Distinct tokens, so MoE rows spread over experts as real ones do (identical rows share two).
    ids = torch.arange(max(widths) + 8, dtype=torch.long, device=device) * 7919 % decoder.cfg.vocab_size
    decoder.forward(ids[:8], Step.span(0, 8, device, prefill=True), cache)
    cache.commit(8)
    seconds = {}
    rows = ids.tolist()
    for w in widths:
        best = float("inf")
        for _ in range(2):  # the first run of a width also captures its graph: the second is the one
            start = clock()
            runner.step(rows[:w], Step.span(8, w, device), cache, feature_layers)
            best = min(best, clock() - start)
            cache.rollback(8)
        seconds[w] = best
    cache.commit(8)  # the step completed: the cache is clean, so the first request can reuse it
    return seconds
