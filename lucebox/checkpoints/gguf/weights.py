"""Our tensors (see `lucebox.models.layout`) from a GGUF file's llama.cpp-named tensors.

Every supported architecture uses llama.cpp's common names: `token_embd`, `output_norm`, `output`,
and per block `blk.{i}.attn_norm`, `attn_q/k/v/output` (+ `.bias`), `attn_q_norm`, `attn_k_norm`,
`attn_gate`, `ffn_norm`, `ffn_gate/up/down`, `ffn_gate_inp` (router), `exp_probs_b` (router
bias), `ffn_{gate,up,down}_exps` (experts, already stacked) and `ffn_{gate,up,down}_shexp`.

Quantized linear weights stay quantized (`lucebox.checkpoints.gguf.blocks`); embeddings, the output head,
routers, norms and biases are read in the model dtype, as lucebox keeps them for its own
quantization. llama.cpp's converter interleaves the two rotary halves of each attention head's
q and k rows for architecture `llama` (its RoPE rotates adjacent pairs); we put them back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lucebox.checkpoints.gguf.file import GGUFFile
from lucebox.config import ModelConfig
from lucebox.errors import MissingTensorError, TensorShapeError, UnexpectedTensorError
from lucebox.kernels.quant import QuantizedTensor, dequantize
from lucebox.memory.expert_cache import is_routed_expert
from lucebox.memory.plan import StoredWeights
from lucebox.models.layout import quantizable, weight_shapes

Weight = torch.Tensor | QuantizedTensor
ROTARY_INTERLEAVED = ("llama",)  # architectures whose converter interleaves q/k rotary halves


@dataclass(frozen=True)
class GGUFSource:
    names: tuple[str, ...]  # GGUF tensors, concatenated along the output rows
    heads: int = 0  # > 0: undo the rotary interleave of this many heads' rows


def gguf_sources(cfg: ModelConfig, arch: str) -> dict[str, GGUFSource]:
    interleaved = arch in ROTARY_INTERLEAVED
    sources = {"embed": GGUFSource(("token_embd.weight",)), "norm": GGUFSource(("output_norm.weight",))}
    if not cfg.tie_word_embeddings:
        sources["lm_head"] = GGUFSource(("output.weight",))
    for i, layer in enumerate(cfg.layers):
        p, b = f"layers.{i}.", f"blk.{i}."

        def one(name: str, heads: int = 0, block: str = b) -> GGUFSource:
            return GGUFSource((block + name,), heads if interleaved else 0)

        q_heads, kv_heads = layer.num_heads, cfg.num_kv_heads
        sources.update({p + "attn_norm": one("attn_norm.weight"), p + "mlp_norm": one("ffn_norm.weight"),
                        p + "wq": one("attn_q.weight", q_heads), p + "wk": one("attn_k.weight", kv_heads),
                        p + "wv": one("attn_v.weight"), p + "wo": one("attn_output.weight")})
        if cfg.attention_bias:
            sources.update({p + "bq": one("attn_q.bias", q_heads), p + "bk": one("attn_k.bias", kv_heads),
                            p + "bv": one("attn_v.bias"), p + "bo": one("attn_output.bias")})
        if cfg.qk_norm:
            sources.update({p + "q_norm": one("attn_q_norm.weight"), p + "k_norm": one("attn_k_norm.weight")})
        if cfg.attention_gate:
            sources[p + "wg"] = one("attn_gate.weight")
        if layer.mlp == "dense":
            sources[p + "w_gate_up"] = GGUFSource((b + "ffn_gate.weight", b + "ffn_up.weight"))
            sources[p + "w_down"] = one("ffn_down.weight")
            continue
        sources[p + "router"] = one("ffn_gate_inp.weight")
        sources[p + "experts_gate_up"] = GGUFSource((b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"))
        sources[p + "experts_down"] = one("ffn_down_exps.weight")
        if cfg.moe.correction_bias:
            sources[p + "router_bias"] = one("exp_probs_b.bias")
        if cfg.moe.shared_expert_size:
            sources[p + "shared_gate_up"] = GGUFSource((b + "ffn_gate_shexp.weight", b + "ffn_up_shexp.weight"))
            sources[p + "shared_down"] = one("ffn_down_shexp.weight")
    return sources


def rotary_halves_order(rows: int, heads: int) -> torch.Tensor:
    """Row indices that turn llama.cpp's interleaved rotary layout back into halves: in each head
    of D rows, our row h * D + j (j < D/2: first half, else second) is its row h * D + 2 * (j mod
    D/2) + (j >= D/2)."""
    D = rows // heads
    within = torch.arange(D).view(D // 2, 2).t().reshape(-1)
    return (torch.arange(heads)[:, None] * D + within).reshape(-1)


def take_rows(w: Weight, order: torch.Tensor) -> Weight:
    """w with its output rows (dim -2 of a matrix, dim 0 of a vector) reordered; quantized blocks
    run along the input features, so whole rows move intact."""
    if isinstance(w, QuantizedTensor):
        pick = order.to(w.codes.device)
        mins = None if w.mins is None else w.mins.index_select(-2, pick)
        zeros = None if w.zeros is None else w.zeros.index_select(-2, pick)
        return QuantizedTensor(w.codes.index_select(-2, pick), w.scales.index_select(-2, pick), zeros, w.bits,
                               w.group, w.shape, w.dtype, mins)
    return w.index_select(-2 if w.dim() > 1 else 0, order.to(w.device))


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


# Bytes per weight of each block type once repacked (codes + scales + mins; see gguf_blocks).
_REPACKED_BYTES = {"Q8_0": 1 + 2 / 32, "Q4_0": 0.5 + 2 / 32, "Q4_K": 0.5 + 8 / 32, "Q5_K": 1 + 8 / 32,
                   "Q6_K": 1 + 4 / 16}


def device_bytes(file: GGUFFile, cfg: ModelConfig, arch: str, dtype: torch.dtype) -> StoredWeights:
    """The bytes `load_gguf_weights` will hold (all, and the routed experts'), read from the file's
    index before loading: linear weights in their repacked block types (fused halves of different
    types are counted as if not widened), everything else in `dtype`."""
    total = experts = 0.0
    for name, source in gguf_sources(cfg, arch).items():
        for n in source.names:
            entry = file.tensors.get(n)
            if entry is not None:
                per_weight = _REPACKED_BYTES.get(entry.type_name) if quantizable(name) else None
                size = math.prod(entry.shape) * (per_weight or dtype.itemsize)
                total += size
                experts += size if is_routed_expert(name) else 0
    return StoredWeights(int(total), int(experts))


ROPE_FREQS = "rope_freqs.weight"  # Llama 3's RoPE scaling as per-frequency divisors (gguf_loading)


def _check_present(file: GGUFFile, sources: dict[str, GGUFSource]) -> None:
    missing = [n for s in sources.values() for n in s.names if n not in file]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingTensorError(f"{file.path.name} lacks {len(missing)} tensor(s) the architecture needs: "
                                 f"{', '.join(missing[:8])}{more}")
    used = {n for s in sources.values() for n in s.names} | {ROPE_FREQS}  # that one is read with the config
    extra = sorted(n for n in file.tensors if n not in used)
    if extra:
        more = f" and {len(extra) - 8} more" if len(extra) > 8 else ""
        raise UnexpectedTensorError(f"{file.path.name} has {len(extra)} tensor(s) lucebox does not use for this "
                                    f"architecture: {', '.join(extra[:8])}{more}")


def _check_shapes(file: GGUFFile, sources: dict[str, GGUFSource], shapes: dict) -> None:
    """Every part in the shape the metadata implies, from the index, before any is read: the parts
    of a fused weight (gate and up) split its rows evenly."""
    for name, source in sources.items():
        *lead, rows, width = shapes[name] if len(shapes[name]) > 1 else (shapes[name][0], None)
        part = (*lead, rows // len(source.names)) + (() if width is None else (width,))
        for n in source.names:
            if file.shape(n) != part:
                raise TensorShapeError(f"{file.path.name}: {n} has shape {list(file.shape(n))}, the metadata "
                                       f"implies {list(part)} (for {name})")


def load_gguf_weights(file: GGUFFile, cfg: ModelConfig, arch: str, dtype: torch.dtype, device,
                      transform=None, progress=None) -> dict[str, Weight]:
    """Every tensor the config needs, one at a time; `transform(name, tensor)` (lucebox's own
    quantization) applies to linear weights the file stores as floats."""
    sources = gguf_sources(cfg, arch)
    _check_present(file, sources)
    shapes = weight_shapes(cfg)
    _check_shapes(file, sources, shapes)
    total = sum(file.tensors[n].nbytes for s in sources.values() for n in s.names)
    done = 0
    weights: dict[str, Weight] = {}
    for name, source in sources.items():
        target = device(name) if callable(device) else device  # experts bound for host memory are read there
        w = concat_rows([file.read(n, dtype, target) for n in source.names])
        if source.heads:
            w = take_rows(w, rotary_halves_order(shapes[name][0], source.heads))
        if not quantizable(name) and isinstance(w, QuantizedTensor):
            w = dequantize(w)  # read whole or indexed by token: kept in the model dtype, like our own quantization
        elif transform is not None:  # lucebox's quantization of float weights, and where each weight lives
            w = transform(name, w)
        weights[name] = w
        done += sum(file.tensors[n].nbytes for n in source.names)
        if progress is not None:
            progress(done, total)
    return weights
