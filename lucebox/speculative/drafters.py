"""Turning `LLM(draft=...)` into a proposer: None, "ngram", "mtp" (the model's own MTP head),
"auto", or a drafter folder (a DFlash drafter, or a smaller model of a supported architecture
sharing the target's vocabulary)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.checkpoints.gguf.file import GGUFFile, locate_gguf
from lucebox.checkpoints.gguf.hybrid_weights import HYBRID_ARCHITECTURES
from lucebox.checkpoints.gguf.nextn import load_nextn_head, nextn_block
from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, locate_config, read_json, weight_files
from lucebox.checkpoints.loading import ModelDescription, describe_model, load_model, quantizer
from lucebox.config import ModelConfig
from lucebox.device import DeviceClock
from lucebox.errors import DraftModelError, ModelNotFoundError
from lucebox.kernels.quant import quantized_bytes
from lucebox.limits import DECODE_ROWS
from lucebox.memory.plan import DrafterCost, cache_ring_bytes, ring_bytes, weight_bytes
from lucebox.models import dflash, mtp
from lucebox.models.decoder import Decoder
from lucebox.models.hf_config import architecture_name
from lucebox.models.layout import quantizable
from lucebox.speculative.dflash import DFlashProposer, ring_step
from lucebox.speculative.draft_model import DraftModelProposer, draft_cache_settings
from lucebox.speculative.mtp import MTPProposer
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


@dataclass(frozen=True)
class DrafterSpec:
    """What `draft=` names, read from config.json before anything is loaded: "ngram", a DFlash
    drafter (`dflash`: its config), a draft model (`model`: its description) or the target's MTP
    head ("mtp": `model` is the target's description, `head` the head's one-layer config), with
    the folder it is read from."""

    kind: str
    folder: Path | None = None
    dflash: dflash.DFlashConfig | None = None
    model: ModelDescription | None = None
    head: ModelConfig | None = None
    head_file: GGUFFile | None = None  # an MTP-only GGUF file the head is read from
    layout: str = "checkpoint"  # an MTP head's tensor names: the checkpoint's (mtp.*) or "speculators"
    quantization: str | None = None  # an MTP head's linear layers, as the target's (`lucebox.kernels.quant`)


def _mtp_layers(target: ModelDescription) -> int:
    """How many layers the target's MTP head has (0: no head). config.json's `mtp_num_hidden_layers`,
    or when it is absent (some Qwen3.6 uploads ship the head without it) the weights' own count."""
    if target.gguf is not None:  # `gguf.hybrid_config` read nextn_predict_layers
        return mtp.declared_layers(target.hf_config)
    if target.quantization is not None:  # (a saved quantized checkpoint holds the model's tensors only)
        return 0
    try:
        index = CheckpointIndex(weight_files(target.folder))
    except ModelNotFoundError:  # no weights to read a head from (load_format='dummy'; else the model's load says so)
        return 0
    if "mtp.fc.weight" not in index:
        return 0
    stored = {name.split(".")[2] for name in index.location if name.startswith("mtp.layers.")}
    return mtp.declared_layers(target.hf_config) or len(stored)


def mtp_drafter(target: ModelDescription) -> DrafterSpec | None:
    """The target's MTP head when it has one lucebox runs (one layer), else None."""
    if _mtp_layers(target) != 1:
        return None
    folder = None if target.gguf is not None else target.folder  # None: the GGUF file's nextn block
    return DrafterSpec("mtp", folder, model=target, head=mtp.head_config(target.cfg))


def _own_mtp(target: ModelDescription) -> DrafterSpec:
    spec = mtp_drafter(target)
    if spec is None:
        layers = _mtp_layers(target)
        why = (f"its head has {layers} layers (lucebox runs a one-layer head)" if layers > 1
               else "its checkpoint holds no MTP head (mtp.* tensors)")
        raise DraftModelError(f"draft='mtp': {target.folder} has no MTP head lucebox can run: {why}; pass "
                              "draft='auto', 'ngram', a drafter folder, or None")
    return spec


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
        return _own_mtp(target)
    if draft == "auto":  # a drafter shipped beside the model, else the model's own MTP head
        draft = paired_drafter(target.folder)
        if draft is None:
            return mtp_drafter(target)
    head_file = locate_gguf(draft)
    if head_file is not None:
        return _mtp_file(GGUFFile(head_file), target)
    config_path = locate_config(draft)
    hf = read_json(config_path)
    arch = architecture_name(hf)
    folder = config_path.parent
    index = CheckpointIndex(weight_files(folder))  # a drafter without weights says so before any memory figure
    if hf.get("speculators_model_type") == "mtp":  # the Speculators library's MTP layout
        return _separate_mtp(hf.get("transformer_layer_config"), folder, target, "speculators")
    if "mtp.fc.weight" in index and not any(name.startswith("model.") for name in index.location):
        return _separate_mtp(hf.get("text_config", hf), folder, target)
    if arch in dflash.ARCHITECTURES:
        cfg = dflash.build_config(hf)
        _check_dflash(cfg, target.cfg, folder)
        return DrafterSpec("dflash", folder, dflash=cfg)
    desc = describe_model(folder)  # a target-style model used as drafter
    if desc.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftModelError(f"draft model {folder} has a vocabulary of {desc.cfg.vocab_size} tokens, the target "
                              f"{target.cfg.vocab_size}; a draft model must share the target's vocabulary")
    return DrafterSpec("model", folder, model=desc)


def _separate_mtp(text, folder: Path, target: ModelDescription, layout: str = "checkpoint") -> DrafterSpec:
    """An MTP head in a folder of its own (`lucebox distill --heads mtp`, or the Speculators
    library's), for this target; `text`: the config.json fields of the model it was made for."""
    text = text if isinstance(text, dict) else {}
    sizes = {"hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size}
    wrong = [f"{key} {text.get(key)} != the target's {value}" for key, value in sizes.items() if text.get(key) != value]
    if wrong:
        raise DraftModelError(f"MTP head {folder} is not this target's: " + "; ".join(wrong))
    return DrafterSpec("mtp", folder, model=target, head=mtp.head_config(target.cfg), layout=layout)


def _mtp_file(file: GGUFFile, target: ModelDescription) -> DrafterSpec:
    """An MTP-only GGUF file (llama.cpp's converter with --mtp), for this target."""
    block, arch = nextn_block(file), str(file.metadata.get("general.architecture"))
    if block is None or "blk.0.attn_norm.weight" in file:
        raise DraftModelError(f"{file.path.name} is not an MTP-only GGUF file (its blk.N.nextn.* head alone); "
                              "lucebox drafts from a GGUF file's MTP head only: pass a drafter folder, 'ngram' or "
                              "'auto'")
    if block != target.cfg.num_layers or arch not in HYBRID_ARCHITECTURES:
        raise DraftModelError(f"{file.path.name} is the MTP head of a {block}-layer {arch} model; the target has "
                              f"{target.cfg.num_layers} layers")
    experts = target.cfg.moe.num_experts if target.cfg.moe is not None else None
    for key, theirs in (("embedding_length", target.cfg.hidden_size), ("expert_count", experts)):
        mine = file.metadata.get(f"{arch}.{key}")
        if mine != theirs:
            raise DraftModelError(f"{file.path.name} is not this target's MTP head: {arch}.{key} {mine} != the "
                                  f"target's {theirs}")
    return DrafterSpec("mtp", file.path.parent, model=target, head=mtp.head_config(target.cfg), head_file=file)


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
        head = mtp.MTPHead(spec.head, _mtp_weights(spec, target.dtype, target.device), target)
        return MTPProposer(head, target, max_context, prefill_chunk, draft_ctx, max_width)
    decoder: Decoder = load_model(spec.model, target.dtype, target.device, kernels=target.kernels).decoder
    return DraftModelProposer(decoder, max_context, prefill_chunk, draft_ctx, max_width)


def _mtp_weights(spec: DrafterSpec, dtype: torch.dtype, device: torch.device) -> dict:
    """The MTP head's tensors: a GGUF file's nextn block, or a folder's mtp.* tensors."""
    if spec.head_file is not None or spec.folder is None:  # an MTP-only file, or the target file's own head
        file = spec.head_file or spec.model.gguf.file
        arch = str(file.metadata["general.architecture"])
        return load_nextn_head(file, spec.head, arch, spec.model.cfg.num_layers, dtype, device)
    return load_weights(CheckpointIndex(weight_files(spec.folder)), mtp.head_sources(spec.head, spec.layout),
                        mtp.head_shapes(spec.head), dtype, device, mtp.THE_MODEL, quantizer(spec.quantization))


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
