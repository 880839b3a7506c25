"""config.json fields of llama.cpp's Gated DeltaNet hybrids from their GGUF metadata: `qwen3next`
(Qwen3NextForCausalLM), `qwen35` (Qwen3_5ForCausalLM) and `qwen35moe` (Qwen3_5MoeForCausalLM).

Keys as llama.cpp's converter writes them (convert_hf_to_gguf.py Qwen3NextModel.set_gguf_parameters,
inherited by the Qwen3.5 classes) and reads them (src/models/qwen3next.cpp, qwen35.cpp, qwen35moe.cpp):
  ssm.conv_kernel    = linear_conv_kernel_dim
  ssm.state_size     = linear_key_head_dim
  ssm.group_count    = linear_num_key_heads
  ssm.time_step_rank = linear_num_value_heads
  ssm.inner_size     = linear_value_head_dim * linear_num_value_heads
  full_attention_interval (default 4: layer i is full attention when (i + 1) % interval == 0),
    unless attention.recurrent_layers lists one bool per layer;
  rope.dimension_count = head_dim * partial_rotary_factor (0.25 unless stated);
  rope.dimension_sections (qwen35*: mrope's t, h, w shares, padded to 4; with text positions all
    equal it is plain RoPE);
  expert_count, expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length.
llama.cpp always renormalizes the chosen experts' weights for these architectures. A file that
carries the model's MTP head (nextn_predict_layers = 1) holds it as one more block after the
model's (block_count counts it: `gguf/nextn.py` reads it as the drafter); more MTP layers are refused.
Names are typed out, as elsewhere in this package (importing gguf-py costs ~0.2 s at start-up);
the tests write their files with gguf-py's own constants and tensor map, so the two must agree.
"""

from __future__ import annotations

from lucebox.errors import ConfigError

_REQUIRED = object()


def whole_number(meta, suffix: str, default=_REQUIRED) -> int:
    """`{arch}.{suffix}` as an int; anything else (1.5, inf, a string) is refused naming the key."""
    value = meta.require(suffix) if default is _REQUIRED else meta.get(suffix, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.{suffix}' is {str(value)[:40]!r}; it must be a whole "
                          "number")
    return value


def _linear_attention(meta, hf: dict) -> dict:
    value_heads = whole_number(meta, "ssm.time_step_rank")
    inner = whole_number(meta, "ssm.inner_size")
    if value_heads < 1 or inner % value_heads:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.ssm.inner_size' ({inner}) is not a whole number of "
                          f"'{meta.arch}.ssm.time_step_rank' ({value_heads}) value heads")
    return {"linear_conv_kernel_dim": whole_number(meta, "ssm.conv_kernel"),
            "linear_key_head_dim": whole_number(meta, "ssm.state_size"),
            "linear_num_key_heads": whole_number(meta, "ssm.group_count"),
            "linear_num_value_heads": value_heads, "linear_value_head_dim": inner // value_heads}


def _layer_types(meta, n: int) -> list[str]:
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is None:
        interval = whole_number(meta, "full_attention_interval", 4)
        if interval < 1:
            raise ConfigError(f"{meta.source.name}: '{meta.arch}.full_attention_interval' is {interval}; it must be "
                              "at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    if isinstance(recurrent, list) and len(recurrent) == n + whole_number(meta, "nextn_predict_layers", 0):
        recurrent = recurrent[:n]  # the MTP head's block, listed after the model's
    if not isinstance(recurrent, list) or len(recurrent) != n or not all(isinstance(r, bool) for r in recurrent):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.attention.recurrent_layers' must list one bool for "
                          f"each of the {n} layers")
    return ["linear_attention" if r else "full_attention" for r in recurrent]


def _hybrid(meta, hf: dict, architecture: str) -> dict:
    nextn = whole_number(meta, "nextn_predict_layers", 0)
    if nextn not in (0, 1) or nextn >= hf["num_hidden_layers"]:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.nextn_predict_layers' is {nextn}; lucebox runs an MTP "
                          "head of one layer (convert the model with one, or without it)")
    if nextn:  # the head's block comes after the model's: block_count counts it
        hf.update(num_hidden_layers=hf["num_hidden_layers"] - 1, mtp_num_hidden_layers=1)
    rope = dict(hf["rope_parameters"])
    rope["partial_rotary_factor"] = whole_number(meta, "rope.dimension_count", hf["head_dim"]) / hf["head_dim"]
    sections = meta.get("rope.dimension_sections")
    if sections is not None:
        rope.update(mrope_section=list(sections)[:3], mrope_interleaved=True)
    hf.update(architectures=[architecture], rope_parameters=rope,
              layer_types=_layer_types(meta, hf["num_hidden_layers"]), **_linear_attention(meta, hf))
    return hf


def _experts(meta, hf: dict) -> dict:
    return {"num_experts": whole_number(meta, "expert_count"),
            "num_experts_per_tok": whole_number(meta, "expert_used_count"),
            "moe_intermediate_size": whole_number(meta, "expert_feed_forward_length"),
            "shared_expert_intermediate_size": whole_number(meta, "expert_shared_feed_forward_length",
                                                      hf["intermediate_size"]),
            "norm_topk_prob": True}


def qwen3next(meta, hf: dict, has, shape) -> dict:
    hf = _hybrid(meta, hf, "Qwen3NextForCausalLM")
    # llama.cpp's qwen3next has experts in every layer; a layer without a router is dense here.
    hf.update(_experts(meta, hf), mlp_only_layers=[i for i in range(hf["num_hidden_layers"])
                                                   if not has(f"blk.{i}.ffn_gate_inp.weight")])
    return hf


def qwen35(meta, hf: dict, has, shape) -> dict:
    return _hybrid(meta, hf, "Qwen3_5ForCausalLM")


def qwen35moe(meta, hf: dict, has, shape) -> dict:
    hf = _hybrid(meta, hf, "Qwen3_5MoeForCausalLM")
    hf.update(_experts(meta, hf))
    return hf
