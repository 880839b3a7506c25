"""Where an MTP head comes from (`models/mtp.py`): the model's own checkpoint (mtp.* beside its
weights, or a GGUF file's nextn block), a folder of its own (`lucebox distill --heads mtp`, or the
Speculators library's "mtp" layout), or an MTP-only GGUF file; and its weights, read with the
target's quantization."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from lucebox.checkpoints.gguf.file import GGUFFile
from lucebox.checkpoints.gguf.hybrid_weights import HYBRID_ARCHITECTURES
from lucebox.checkpoints.gguf.nextn import load_nextn_head, nextn_block, nextn_sources
from lucebox.checkpoints.hf_folder import CheckpointIndex, load_weights, weight_files
from lucebox.checkpoints.loading import ModelDescription, quantizer
from lucebox.checkpoints.source_check import resolve_sources
from lucebox.errors import (
    DraftModelError,
    LuceboxWarning,
    MissingTensorError,
    ModelNotFoundError,
    TensorShapeError,
    UnexpectedTensorError,
)
from lucebox.models import mtp
from lucebox.speculative.drafter_spec import DrafterSpec


def head_layers(target: ModelDescription) -> int:
    """How many layers the target's MTP head has (0: no head). config.json's `mtp_num_hidden_layers`
    (or `num_nextn_predict_layers`), or when it is absent (some Qwen3.6 uploads ship the head without
    it) the weights' own count."""
    return _stored_head(target)[0]


def _stored_head(target: ModelDescription) -> tuple[int, str]:
    """(layers, layout) of the MTP head the target's checkpoint holds: mtp.* ("checkpoint",
    Qwen's) or DeepSeek-V3's layers after the model's ("deepseek", GLM-4.5's); 0 layers: none."""
    if target.gguf is not None:  # `gguf.hybrid_config` and `gguf.glm_config` read nextn_predict_layers
        return mtp.declared_layers(target.hf_config), "checkpoint"
    if target.quantization is not None:  # (a saved quantized checkpoint holds the model's tensors only)
        return 0, "checkpoint"
    try:
        index = CheckpointIndex(weight_files(target.folder))
    except ModelNotFoundError:  # no weights to read a head from (load_format='dummy'; else the model's load says so)
        return 0, "checkpoint"
    declared, n = mtp.declared_layers(target.hf_config), target.cfg.num_layers
    if f"model.layers.{n}.eh_proj.weight" in index:
        stored = {m for m in range(n, n + 64) if f"model.layers.{m}.eh_proj.weight" in index}
        return declared or len(stored), "deepseek"
    if "mtp.fc.weight" not in index:
        return 0, "checkpoint"
    stored = {name.split(".")[2] for name in index.location if name.startswith("mtp.layers.")}
    return declared or len(stored), "checkpoint"


def mtp_drafter(target: ModelDescription, asked: bool = False) -> DrafterSpec | None:
    """The target's MTP head when it has one lucebox runs (one layer, every tensor there), else
    None: for `draft='auto'`, a head that is incomplete (an upload that dropped some of its
    tensors) is left out with a warning rather than stop the model from loading; asked for by name
    (`asked`), its missing tensors are the error."""
    layers, layout = _stored_head(target)
    if layers != 1:
        return None
    folder = None if target.gguf is not None else target.folder  # None: the GGUF file's nextn block
    spec = DrafterSpec("mtp", folder, model=target, head=mtp.head_config(target.cfg), layout=layout)
    try:
        _check_head_tensors(spec)
    except (MissingTensorError, TensorShapeError, UnexpectedTensorError) as e:
        if asked:
            raise
        warnings.warn(f"the model's MTP head is incomplete ({e}); decoding without it", LuceboxWarning, stacklevel=6)
        return None
    return spec


def _check_head_tensors(spec: DrafterSpec) -> None:
    """Every tensor of the target's own head is in its checkpoint, in its shape (nothing read)."""
    target = spec.model
    if target.gguf is not None:
        file = target.gguf.file
        sources = nextn_sources(spec.head, target.gguf.architecture, target.cfg.num_layers, file.__contains__)
        missing = [n for source in sources.values() for n in source.names if n not in file]
        if missing:
            raise MissingTensorError(f"{file.path.name} lacks {len(missing)} of its MTP head's tensors: "
                                     f"{', '.join(missing[:8])}")
        return
    resolve_sources(mtp.head_sources(spec.head, spec.layout, target.cfg.num_layers), mtp.head_shapes(spec.head),
                    CheckpointIndex(weight_files(spec.folder)), mtp.THE_MODEL)


def own_mtp(target: ModelDescription) -> DrafterSpec:
    spec = mtp_drafter(target, asked=True)
    if spec is None:
        layers = head_layers(target)
        why = (f"its head has {layers} layers (lucebox runs a one-layer head)" if layers > 1
               else "its checkpoint holds no MTP head (mtp.* tensors, or DeepSeek-V3's layer after the model's)")
        raise DraftModelError(f"draft='mtp': {target.folder} has no MTP head lucebox can run: {why}; pass "
                              "draft='auto', 'ngram', a drafter folder, or None")
    return spec


def separate_mtp(text, folder: Path, target: ModelDescription, layout: str = "checkpoint") -> DrafterSpec:
    """An MTP head in a folder of its own (`lucebox distill --heads mtp`, or the Speculators
    library's), for this target; `text`: the config.json fields of the model it was made for."""
    text = text if isinstance(text, dict) else {}
    sizes = {"hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size}
    wrong = [f"{key} {text.get(key)} != the target's {value}" for key, value in sizes.items() if text.get(key) != value]
    if wrong:
        raise DraftModelError(f"MTP head {folder} is not this target's: " + "; ".join(wrong))
    return DrafterSpec("mtp", folder, model=target, head=mtp.head_config(target.cfg), layout=layout)


def mtp_file(file: GGUFFile, target: ModelDescription) -> DrafterSpec:
    """An MTP-only GGUF file (llama.cpp's converter with --mtp), for this target."""
    block, arch = nextn_block(file), str(file.metadata.get("general.architecture"))
    if block is None or "blk.0.attn_norm.weight" in file:
        raise DraftModelError(f"{file.path.name} is not an MTP-only GGUF file (its blk.N.nextn.* head alone); "
                              "lucebox drafts from a GGUF file's MTP head only: pass a drafter folder, 'ngram' or "
                              "'auto'")
    if target.gguf is not None and arch != target.gguf.architecture:
        raise DraftModelError(f"{file.path.name} is the MTP head of a {arch} model; the target is "
                              f"{target.gguf.architecture}")
    if block != target.cfg.num_layers or arch not in (*HYBRID_ARCHITECTURES, "glm4moe"):
        raise DraftModelError(f"{file.path.name} is the MTP head of a {block}-layer {arch} model; the target has "
                              f"{target.cfg.num_layers} layers")
    experts = target.cfg.moe.num_experts if target.cfg.moe is not None else None
    for key, theirs in (("embedding_length", target.cfg.hidden_size), ("expert_count", experts)):
        mine = file.metadata.get(f"{arch}.{key}")
        if mine != theirs:
            raise DraftModelError(f"{file.path.name} is not this target's MTP head: {arch}.{key} {mine} != the "
                                  f"target's {theirs}")
    return DrafterSpec("mtp", file.path.parent, model=target, head=mtp.head_config(target.cfg), head_file=file)


def mtp_weights(spec: DrafterSpec, dtype: torch.dtype, device: torch.device) -> dict:
    """The MTP head's tensors: a GGUF file's nextn block, or a folder's mtp.* tensors."""
    if spec.head_file is not None or spec.folder is None:  # an MTP-only file, or the target file's own head
        file = spec.head_file or spec.model.gguf.file
        arch = str(file.metadata["general.architecture"])
        return load_nextn_head(file, spec.head, arch, spec.model.cfg.num_layers, dtype, device)
    sources = mtp.head_sources(spec.head, spec.layout, spec.model.cfg.num_layers)
    return load_weights(CheckpointIndex(weight_files(spec.folder)), sources, mtp.head_shapes(spec.head), dtype, device,
                        mtp.THE_MODEL, quantizer(spec.quantization))
