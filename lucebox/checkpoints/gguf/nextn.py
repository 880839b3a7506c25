"""The MTP head of a llama.cpp GGUF file (`{arch}.nextn_predict_layers` = 1), as `models/mtp.py`
names it.

llama.cpp's converter writes the head as one more block after the model's, blk.N with N the
model's layer count (block_count counts it): the decoder layer under the names every block uses
(attn_norm, attn_q, ..., post_attention_norm, ffn_*), and beside it nextn.eh_proj (mtp.fc),
nextn.enorm (mtp.pre_fc_norm_embedding), nextn.hnorm (mtp.pre_fc_norm_hidden) and
nextn.shared_head_norm (mtp.norm). Like every "*norm.weight" of the Qwen hybrids, their three norms
are stored as 1 + w (`hybrid_weights`), which the read undoes; GLM-4.5's (`glm4moe`, DeepSeek-V3's
head) are plain. The head shares the model's token embedding and output head, which the file holds
once (the copies beside it, nextn.embed_tokens and nextn.shared_head_head, are left unread).

The converter's `--mtp` writes the head alone, an MTP-only file (the same metadata, the head's
block, and copies of the token embedding, output norm and head that lucebox leaves unread: the
target's own are the ones the head shares), which `draft=` takes beside a model without one.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from lucebox.checkpoints.gguf.file import GGUFFile
from lucebox.checkpoints.gguf.hybrid_weights import HYBRID_ARCHITECTURES
from lucebox.checkpoints.gguf.reorder import GGUFSource
from lucebox.checkpoints.gguf.weights import gguf_sources, read_sources
from lucebox.config import ModelConfig
from lucebox.errors import MissingTensorError
from lucebox.models import mtp


def nextn_block(file: GGUFFile) -> int | None:
    """The block that holds an MTP head in `file` (None: none does)."""
    blocks = [int(m[1]) for name in file.tensors if (m := re.fullmatch(r"blk\.(\d+)\.nextn\.eh_proj\.weight", name))]
    return max(blocks) if blocks else None


def nextn_sources(head: ModelConfig, arch: str, block: int, has) -> dict[str, GGUFSource]:
    """Where the head's tensors lie: its layer's as block 0's would, moved to blk.`block`."""
    b = f"blk.{block}."

    def moved(source: GGUFSource) -> GGUFSource:
        return replace(source, names=tuple(n.replace("blk.0.", b, 1) for n in source.names))

    layer = {name: moved(source) for name, source in gguf_sources(head, arch, has).items()
             if name.startswith("layers.0.")}
    norm = GGUFSource((b + "nextn.shared_head_norm.weight",),
                      value="offset_norm" if arch in HYBRID_ARCHITECTURES else None)
    return {**layer, "norm": norm, "fc": GGUFSource((b + "nextn.eh_proj.weight",)),
            "norm_embedding": replace(norm, names=(b + "nextn.enorm.weight",)),
            "norm_hidden": replace(norm, names=(b + "nextn.hnorm.weight",))}


def load_nextn_head(file: GGUFFile, head: ModelConfig, arch: str, block: int, dtype: torch.dtype,
                    device: torch.device) -> dict:
    """The head's weights, named as `mtp.MTPHead` takes them."""
    sources = nextn_sources(head, arch, block, file.__contains__)
    missing = [n for source in sources.values() for n in source.names if n not in file]
    if missing:
        raise MissingTensorError(f"{file.path.name} declares an MTP head ({arch}.nextn_predict_layers) but lacks "
                                 f"{len(missing)} of its tensors: {', '.join(missing[:8])}")
    return read_sources(file, sources, mtp.head_shapes(head), dtype, device)
