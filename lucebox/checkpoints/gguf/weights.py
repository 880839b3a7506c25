"""Our tensors (see `lucebox.models.layout`) from a GGUF file's llama.cpp-named tensors.

Every supported architecture uses llama.cpp's common names: `token_embd`, `output_norm`, `output`,
and per block `blk.{i}.attn_norm`, `attn_q/k/v/output` (+ `.bias`), `attn_q_norm`, `attn_k_norm`,
`attn_gate`, `ffn_norm`, `ffn_gate/up/down`, `ffn_gate_inp` (router), `exp_probs_b` (router
bias), `ffn_{gate,up,down}_exps` (experts, already stacked) and `ffn_{gate,up,down}_shexp`.

Quantized linear weights stay quantized (`lucebox.checkpoints.gguf.blocks`); embeddings, the output head,
norms and biases are read in the model dtype, as lucebox keeps them for its own quantization, and
routers in float32 (`lucebox.models.layout.stored_dtype`). llama.cpp's converter interleaves the
two rotary halves of each attention head's q and k rows for architecture `llama` (its RoPE rotates
adjacent pairs); we put them back. The Gated DeltaNet hybrids' own names and transforms:
`hybrid_weights`; a file's GDN projections stay quantized too (`keeps_blocks`).
"""

from __future__ import annotations

import math

import torch

from lucebox.checkpoints.gguf.blocks import BLOCK_SHAPES, repacked_bytes
from lucebox.checkpoints.gguf.file import GGUFFile
from lucebox.checkpoints.gguf.hybrid_weights import HYBRID_ARCHITECTURES, hybrid_sources
from lucebox.checkpoints.gguf.kimi_weights import KIMI_ARCHITECTURES, kimi_sources
from lucebox.checkpoints.gguf.reorder import (
    JOINS,
    GGUFSource,
    Weight,
    rotary_halves_order,
    take_column_blocks,
    take_rows,
    undo_value,
)
from lucebox.config import ModelConfig
from lucebox.errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from lucebox.kernels.quant import QuantizedTensor, dequantize
from lucebox.memory.expert_cache import is_routed_expert
from lucebox.memory.plan import StoredWeights
from lucebox.models.layout import quantizable, stored_dtype, weight_shapes

ROTARY_INTERLEAVED = ("llama",)  # architectures whose converter interleaves q/k rotary halves
# The norm before the MLP where it is not `ffn_norm` (the hybrids': `hybrid_weights`)
MLP_NORMS = {"glm4moe": "post_attention_norm.weight"}


def gguf_sources(cfg: ModelConfig, arch: str, has) -> dict[str, GGUFSource]:
    """Where each of our tensors lies; `has(name)` tells which layout a hybrid's file holds."""
    interleaved = arch in ROTARY_INTERLEAVED
    sources = {"embed": GGUFSource(("token_embd.weight",)), "norm": GGUFSource(("output_norm.weight",))}
    if not cfg.tie_word_embeddings:
        sources["lm_head"] = GGUFSource(("output.weight",))
    for i, layer in enumerate(cfg.layers):
        p, b = f"layers.{i}.", f"blk.{i}."

        def one(name: str, heads: int = 0, block: str = b) -> GGUFSource:
            return GGUFSource((block + name,), heads if interleaved else 0)

        q_heads, kv_heads = layer.num_heads, cfg.num_kv_heads
        sources.update({p + "attn_norm": one("attn_norm.weight"),
                        p + "mlp_norm": one(MLP_NORMS.get(arch, "ffn_norm.weight"))})
        if not layer.is_recurrent and cfg.latent_attention is None:  # (others: `hybrid_sources`, `kimi_sources`)
            sources.update(_attention(cfg, p, one, q_heads, kv_heads))
        sources.update(_mlp(cfg, layer, p, b, one))
    if arch in KIMI_ARCHITECTURES:
        return kimi_sources(cfg, sources, has)
    return hybrid_sources(cfg, arch, sources, has) if arch in HYBRID_ARCHITECTURES else sources


def _attention(cfg: ModelConfig, p: str, one, q_heads: int, kv_heads: int) -> dict[str, GGUFSource]:
    sources = {p + "wq": one("attn_q.weight", q_heads), p + "wk": one("attn_k.weight", kv_heads),
               p + "wv": one("attn_v.weight"), p + "wo": one("attn_output.weight")}
    if cfg.attention_bias:
        sources.update({p + "bq": one("attn_q.bias", q_heads), p + "bk": one("attn_k.bias", kv_heads),
                        p + "bv": one("attn_v.bias")})
        if cfg.attention_output_bias:
            sources[p + "bo"] = one("attn_output.bias")
    if cfg.qk_norm:
        sources.update({p + "q_norm": one("attn_q_norm.weight"), p + "k_norm": one("attn_k_norm.weight")})
    if cfg.attention_gate in ("head", "element"):  # (a "sigmoid" gate is fused into attn_q)
        sources[p + "wg"] = one("attn_gate.weight")
    return sources


def _mlp(cfg: ModelConfig, layer, p: str, b: str, one) -> dict[str, GGUFSource]:
    if layer.mlp == "dense":
        return {p + "w_gate_up": GGUFSource((b + "ffn_gate.weight", b + "ffn_up.weight")),
                p + "w_down": one("ffn_down.weight")}
    sources = {p + "router": one("ffn_gate_inp.weight"),
               p + "experts_gate_up": GGUFSource((b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight")),
               p + "experts_down": one("ffn_down_exps.weight")}
    if cfg.moe.correction_bias:
        sources[p + "router_bias"] = one("exp_probs_b.bias")
    if cfg.moe.shared_expert_size:
        sources[p + "shared_gate_up"] = GGUFSource((b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"))
        sources[p + "shared_down"] = one("ffn_down_shexp.weight")
    if cfg.moe.shared_expert_gate:  # [1, H] as transformers holds it, or llama.cpp's [H]
        sources[p + "shared_gate"] = GGUFSource((b + "ffn_gate_inp_shexp.weight",), any_shape=True)
    return sources


def _widened(w: QuantizedTensor, group: int) -> QuantizedTensor:
    """w as int8 codes with float32 scales and mins in groups of `group` (dividing w.group): the
    one layout any two GGUF types share, with the very same values."""
    codes = w.codes
    if w.bits == 4:
        codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(w.shape).to(torch.int16)
        codes = (codes if w.mins is not None else codes - 8).to(torch.int8)  # Q4_0's implicit zero becomes explicit
    repeat = w.group // group
    scales = w.scales.to(torch.float32).repeat_interleave(repeat, dim=-1)
    mins = torch.zeros_like(scales) if w.mins is None else w.mins.repeat_interleave(repeat, dim=-1)
    return QuantizedTensor(codes.contiguous(), scales, None, 8, group, w.shape, w.dtype, mins)


def concat_rows(parts: list[Weight]) -> Weight:
    """Parts concatenated along their output rows. Quantized parts of different types (Q4_K gate,
    Q6_K up) are first widened to one common layout; a float part among quantized ones makes the
    whole tensor float (llama.cpp's quantizers never mix them so)."""
    if len(parts) == 1:
        return parts[0]
    quantized = [p for p in parts if isinstance(p, QuantizedTensor)]
    if not quantized:
        return torch.cat(parts, dim=-2)
    if len(quantized) < len(parts):
        return torch.cat([dequantize(p) if isinstance(p, QuantizedTensor) else p for p in parts], dim=-2)
    layouts = {(p.bits, p.group, p.scales.dtype, p.mins is None) for p in quantized}
    if len(layouts) > 1:
        group = math.gcd(*(p.group for p in quantized))
        quantized = [_widened(p, group) for p in quantized]
    first = quantized[0]
    shape = (*first.shape[:-2], sum(p.shape[-2] for p in quantized), first.shape[-1])
    mins = None if first.mins is None else torch.cat([p.mins for p in quantized], dim=-2)
    return QuantizedTensor(torch.cat([p.codes for p in quantized], dim=-2),
                           torch.cat([p.scales for p in quantized], dim=-2), None, first.bits, first.group, shape,
                           first.dtype, mins)


def device_bytes(file: GGUFFile, cfg: ModelConfig, arch: str, dtype: torch.dtype) -> StoredWeights:
    """The bytes `load_gguf_weights` will hold (all, the routed experts', and at most the dense
    copies of the repacked ones a CPU keeps), read from the file's index before loading: linear
    weights in their repacked block types (fused halves of different types are counted as if not
    widened), everything else in `dtype`."""
    total = experts = dense = 0.0
    for name, source in gguf_sources(cfg, arch, file.__contains__).items():
        for n in source.names:
            entry = file.tensors.get(n)
            if entry is not None:
                repacked = keeps_blocks(name) and entry.type_name in BLOCK_SHAPES
                per_weight = repacked_bytes(entry.type_name) if repacked else None
                size = math.prod(entry.shape) * (per_weight or stored_dtype(name, dtype).itemsize)
                total += size
                experts += size if is_routed_expert(name) else 0
                dense += math.prod(entry.shape) * stored_dtype(name, dtype).itemsize if repacked else 0
    return StoredWeights(int(total), int(experts), int(dense))


# Beyond lucebox's own quantizable weights, a GGUF file's Gated DeltaNet, KDA and MLA projections stay
# in blocks too (kv_b is rebuilt in floats: `kimi_weights`).
_ALSO_IN_BLOCKS = ("gdn_qkvz", "gdn_ba", "gdn_out", "kda_q", "kda_k", "kda_v", "kda_f_a", "kda_f_b", "kda_b",
                   "kda_g_a", "kda_g_b", "kda_out", "wq_a", "wq_b", "wkv_a")


def keeps_blocks(name: str) -> bool:
    return quantizable(name) or name.rsplit(".", 1)[-1] in _ALSO_IN_BLOCKS


ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE scaling as per-frequency divisors (gguf_loading)


def _check_present(file: GGUFFile, sources: dict[str, GGUFSource], unread: tuple[str, ...] = ()) -> None:
    missing = [n for s in sources.values() for n in s.names if n not in file]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingTensorError(f"{file.path.name} lacks {len(missing)} tensor(s) the architecture needs: "
                                 f"{', '.join(missing[:8])}{more}")
    used = {n for s in sources.values() for n in s.names} | {ROPE_FREQS}  # that one is read with the config
    extra = sorted(n for n in file.tensors if n not in used and not n.startswith(unread))
    if extra:
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise UnexpectedTensorError(f"{file.path.name} has {len(extra)} tensor(s) lucebox does not use for this "
                                    f"architecture: {', '.join(extra[:8])}{more}")


def _check_shapes(file: GGUFFile, sources: dict[str, GGUFSource], shapes: dict) -> None:
    """Every part in the shape the metadata implies, from the index, before any is read: the parts
    of a fused weight (gate and up) split its rows evenly unless the source says how."""
    for name, source in sources.items():
        *lead, rows, width = shapes[name] if len(shapes[name]) > 1 else (shapes[name][0], None)
        shares = source.part_rows or (rows // len(source.names),) * len(source.names)
        for i, (n, share) in enumerate(zip(source.names, shares, strict=True)):
            part = (*lead, share) + (() if width is None else (width,))
            if source.part_shapes is not None:
                part = source.part_shapes[i]
            elif source.any_shape:  # any shape holding an equal share of ours, split along its first dim
                part = (shapes[name][0] // len(source.names), *shapes[name][1:])
            fits = math.prod(file.shape(n)) == math.prod(part) if source.any_shape else file.shape(n) == part
            if not fits:
                raise TensorShapeError(f"{file.path.name}: {n} has shape {list(file.shape(n))}, the metadata "
                                       f"implies {list(part)} (for {name})")


def load_gguf_weights(file: GGUFFile, cfg: ModelConfig, arch: str, dtype: torch.dtype, device,
                      transform=None, progress=None) -> dict[str, Weight]:
    """Every tensor the config needs, one at a time; `transform(name, tensor)` (lucebox's own
    quantization) applies to linear weights the file stores as floats. The block of an MTP head
    after the model's is left to the drafter (`gguf.nextn`)."""
    sources = gguf_sources(cfg, arch, file.__contains__)
    head = (f"blk.{len(cfg.layers)}.",) if file.metadata.get(f"{arch}.nextn_predict_layers") else ()
    _check_present(file, sources, unread=head)
    return read_sources(file, sources, weight_shapes(cfg), dtype, device, transform, progress)


def read_sources(file: GGUFFile, sources: dict[str, GGUFSource], shapes: dict, dtype: torch.dtype, device,
                 transform=None, progress=None) -> dict[str, Weight]:
    """Our tensors of `sources`, in `shapes`, checked against the file's index before any is read."""
    _check_shapes(file, sources, shapes)
    total = sum(file.tensors[n].nbytes for s in sources.values() for n in s.names)
    done = 0
    weights: dict[str, Weight] = {}
    for name, source in sources.items():
        target = device(name) if callable(device) else device  # experts bound for host memory are read there
        weights[name] = _read(file, name, source, shapes[name], stored_dtype(name, dtype), target, transform)
        done += sum(file.tensors[n].nbytes for n in source.names)
        if progress is not None:
            progress(done, total)
    return weights


def _read(file: GGUFFile, name: str, source: GGUFSource, shape: tuple[int, ...], dtype: torch.dtype, device,
          transform) -> Weight:
    """Our tensor `name`: its parts read and concatenated, the converter's moves and value changes undone."""
    parts = [file.read(n, dtype, device) for n in source.names]
    if source.joined is not None:
        parts = [dequantize(p).to(dtype) if isinstance(p, QuantizedTensor) else p for p in parts]
        w = JOINS[source.joined](*parts)
        return w if transform is None else transform(name, w)
    if source.any_shape and len(parts) > 1:  # e.g. (1, C, 1, K) convs, stacked along C
        parts = [p.reshape(-1, p.shape[-1]) for p in parts]
    w = concat_rows(parts)
    if source.heads:
        w = take_rows(w, rotary_halves_order(shape[0], source.heads))
    if source.rows is not None:
        w = take_rows(w, source.rows)
    if source.column_blocks is not None:
        w = take_column_blocks(w, source.column_blocks, source.block_width, f"{file.path.name}: {source.names[0]}")
    if not keeps_blocks(name) and isinstance(w, QuantizedTensor):
        # read whole or indexed by token: kept in the model dtype, like our own quantization
        w = dequantize(w).reshape(shape)
        return w if source.value is None else undo_value(w, source.value, f"{file.path.name}: {source.names[0]}")
    if source.any_shape:
        w = w.reshape(shape)
    if source.value is not None:
        w = undo_value(w, source.value, f"{file.path.name}: {source.names[0]}")
    return w if transform is None else transform(name, w)  # lucebox's quantization, and where it lives
