"""How an engine's memory is settled before anything loads: the plan under a VRAM budget, the
size of the expert cache, and the weights' bytes when a GGUF file fixes them."""

from __future__ import annotations

import torch

from lucebox.config import ModelConfig
from lucebox.engine.config import DRAFT_WIDTH
from lucebox.errors import InsufficientMemoryError, InvalidArgumentError
from lucebox.memory.plan import StoredWeights
from lucebox.memory.vram import VramPlan, plan_for_budget
from lucebox.speculative.drafters import drafter_cost


def stored_weights(description, dtype: torch.dtype, load_format: str) -> StoredWeights | None:
    """The weights' bytes as a GGUF file's blocks fix them (None: from the config and `quantization`)."""
    gguf = description.gguf
    return None if gguf is None or load_format == "dummy" else gguf.device_bytes(description.cfg, dtype)


def expert_slots_for(cfg: ModelConfig, on_host: bool | None, slots: int | None) -> int | None:
    """Device slots per MoE layer with the experts in host memory, or None (all on the device).
    Default: 8 rows' worth of choices (8 x top_k), or every expert if there are fewer."""
    moe = cfg.moe
    if not on_host:
        if slots is not None:
            raise InvalidArgumentError("expert_slots needs the experts in host memory; it contradicts "
                                       "experts_on_host=False")
        return None
    if moe is None:
        raise InvalidArgumentError("experts_on_host=True needs a mixture-of-experts model; this one is dense")
    slots = slots or min(moe.num_experts, 8 * moe.top_k)
    if not moe.top_k <= slots <= moe.num_experts:
        raise InvalidArgumentError(f"expert_slots={slots} must be between top_k ({moe.top_k}) and the "
                                   f"{moe.num_experts} experts of a layer")
    return slots


def plan_vram(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, quantization: str | None, budget: int,
              context: int, kv_policy: str | None, kv_pool_tokens: int | None, prefill_chunk: int | None, drafter,
              draft_ctx: int, cuda_graphs: bool | None, experts_on_host: bool | None, expert_slots: int | None,
              kv_int8: bool, stored: StoredWeights | None) -> VramPlan:
    """The planner's choices under the budget (`lucebox.memory.vram`), or InsufficientMemoryError
    saying what does not fit; on CUDA the allocator is held to the budget from here on."""
    largest = 2048 if device.type == "cuda" else 512  # the default prefill chunk
    cost = drafter_cost(drafter, dtype, context, prefill_chunk or largest, draft_ctx, DRAFT_WIDTH)
    graphs = device.type == "cuda" and cuda_graphs is not False
    planned = plan_for_budget(cfg, budget, context, dtype, quantization, cost, kv_policy, kv_pool_tokens,
                              prefill_chunk, graphs, largest, experts_on_host, expert_slots, kv_int8, stored)
    if not planned.fits:
        raise InsufficientMemoryError(f"vram_budget={budget / 2**30:.1f}GiB: {planned.notes[-1]}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    return planned
