"""From an `EngineConfig` to everything an engine is before a byte of weights loads.

`plan_engine` runs one step after another, each a function with one job: the device, dtype and
kernels; the model's description and the drafter `draft` names (checked against it); the memory
choices (the VRAM planner's under a budget, else the configuration's); the cache settings;
whether decode steps run as CUDA graphs; and the memory check, which refuses what cannot fit.
Nothing here allocates device memory (a budget only holds the allocator to it).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from lucebox.caches import CacheSettings
from lucebox.checkpoints.hf_folder import weight_files
from lucebox.checkpoints.loading import ModelDescription, describe_model, resolve_quantization
from lucebox.config import ModelConfig
from lucebox.device import memory_outside_allocator, resolve_device, resolve_dtype
from lucebox.engine.config import EngineConfig
from lucebox.errors import (
    InsufficientMemoryError,
    InvalidArgumentError,
    LuceboxWarning,
    SpeculationUnsupportedError,
)
from lucebox.kernels.backend import resolve_backend
from lucebox.limits import DRAFT_WIDTH, PREFILL_CHUNK
from lucebox.memory.lm_head import choose_lm_head
from lucebox.memory.plan import DrafterCost, StoredWeights, check_fits
from lucebox.memory.vram import VramPlan, plan_for_budget
from lucebox.speculative.drafters import DrafterSpec, drafter_cost, resolve_drafter


@dataclass(frozen=True)
class EngineSetup:
    """An engine's concrete settings: what `EngineConfig` left to the machine and the model, settled."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    backend: str  # "torch" | "triton"
    description: ModelDescription
    quantization: str | None  # the weights' scheme (a saved checkpoint's own, or the one asked for)
    drafter: DrafterSpec | None
    tree_budget: int  # draft rows of a tree round; 0: chains
    prefill_chunk: int
    cache: CacheSettings
    cuda_graphs: bool
    expert_slots: int | None  # device slots per MoE layer with the experts in host memory; None: all on the device
    vram_plan: VramPlan | None  # the planner's, when a budget was given
    memory: dict[str, int]  # bytes of each part (`memory.plan.check_fits`)
    stored_weights: StoredWeights | None  # a GGUF file's own weight bytes
    lm_head: str | None = None  # "int8": the output head as int8 codes (`memory.lm_head`); None: the float head

    @property
    def model(self) -> ModelConfig:
        return self.description.cfg


@dataclass(frozen=True)
class MemoryChoices:
    """The settings a VRAM budget may choose (else the configuration's own)."""

    prefill_chunk: int
    kv_pool_tokens: int | None
    expert_slots: int | None


def plan_engine(config: EngineConfig) -> EngineSetup:
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches and CUDA graph capture follow the current device
    dtype = resolve_dtype(config.dtype, device)
    backend = resolve_backend(config.backend, device, dtype)
    description = describe_model(config.model)
    quantization = resolve_quantization(config.quantization, description)  # a saved scheme may only be repeated
    drafter = resolve_drafter(config.draft, description, quantization)
    refuse_speculation_on_hybrid(drafter, config.draft, description.cfg)
    tree_budget = settle_tree_budget(config.tree_budget, drafter, description.cfg)
    stored = stored_weights(description, dtype, config.load_format)
    lm_head = choose_lm_head(config.lm_head, quantization, backend, description.cfg, dtype,
                             description.gguf is not None, device.type == "cuda")
    max_context = config.max_context or description.cfg.max_position_embeddings
    vram_plan = None
    if config.vram_budget is not None:
        drafter, vram_plan = without_an_unasked_head(config, drafter, lambda drafter: plan_vram(
            config, description.cfg, device, dtype, backend, quantization, drafter, stored, lm_head))
    choices = memory_choices(config, description.cfg, device, vram_plan)
    cache = CacheSettings.for_engine(max_context, choices.prefill_chunk, config.kv_policy, choices.kv_pool_tokens,
                                     config.kv_reselect_every, kv_int8=config.kv_int8)
    cache.kvflash().validate()
    if config.load_format != "dummy" and description.gguf is None:
        weight_files(description.folder)  # a folder without weights says so before any memory figure
    def fits(drafter: DrafterSpec | None) -> dict[str, int]:
        cost = drafter_cost(drafter, dtype, max_context, choices.prefill_chunk, config.draft_ctx, DRAFT_WIDTH)
        return check_fits(description.cfg, cache, dtype, device, quantization, cost, choices.expert_slots, stored,
                          lm_head, config.parallel)

    drafter, memory = without_an_unasked_head(config, drafter, fits)
    graphs = use_cuda_graphs(config.cuda_graphs, device, backend, choices.expert_slots)
    warn_past_training(max_context, description.cfg)  # once the engine is known to open: no warning before an error
    return EngineSetup(config, device, dtype, backend, description, quantization, drafter, tree_budget,
                       choices.prefill_chunk, cache, graphs, choices.expert_slots, vram_plan, memory, stored, lm_head)


def without_an_unasked_head(config: EngineConfig, drafter: DrafterSpec | None, attempt):
    """(drafter, attempt(drafter)); or, when what does not fit (InsufficientMemoryError) is the model's
    own MTP head that draft='auto' found, which nobody asked for by name, (None, attempt(None)) with a
    warning: the model runs without its head rather than not at all."""
    try:
        return drafter, attempt(drafter)
    except InsufficientMemoryError as e:
        if config.draft != "auto" or drafter is None or drafter.kind != "mtp":
            raise
        result = attempt(None)  # (the model alone not fitting either says so, without a word of the head)
        warnings.warn(f"the model's MTP head does not fit beside it ({e}); decoding without a drafter (pass "
                      "draft='mtp' to be told what to make smaller)", LuceboxWarning, stacklevel=6)
        return None, result


def stored_weights(description: ModelDescription, dtype: torch.dtype, load_format: str) -> StoredWeights | None:
    """The weights' bytes as a GGUF file's blocks fix them (None: from the config and `quantization`)."""
    gguf = description.gguf
    return None if gguf is None or load_format == "dummy" else gguf.device_bytes(description.cfg, dtype)


def warn_past_training(max_context: int, cfg: ModelConfig) -> None:
    """A context beyond the model's trained length runs, but its quality is the model's problem:
    say so rather than stay silent."""
    if max_context > cfg.max_position_embeddings:
        warnings.warn(f"max_context={max_context} is beyond the {cfg.max_position_embeddings} tokens this model "
                      "was trained for (max_position_embeddings in config.json); output past that length may "
                      "degrade", LuceboxWarning, stacklevel=5)  # LLM(...)'s caller


def refuse_speculation_on_hybrid(drafter: DrafterSpec | None, draft, cfg: ModelConfig) -> None:
    """A hybrid target keeps a state per verify row (`caches.recurrent`), so chains of drafts
    verify exactly whoever drafts them: n-gram, a draft model of plain attention layers, or a
    DFlash drafter (it reads only the target's hidden states, which a verify step computes as on
    any target). Refused: a draft model with recurrent layers of its own (its cache would need to
    rewind its drafts' states, which a draft model's commits forget); trees: `settle_tree_budget`."""
    if drafter is None or drafter.kind != "model":
        return
    found = f" (draft='auto' found the drafter {drafter.folder})" if draft == "auto" else ""
    if drafter.model.cfg.is_hybrid:
        raise SpeculationUnsupportedError(
            f"a draft model with recurrent (Gated DeltaNet) layers is not supported yet{found}: its cache cannot "
            "rewind the states of rejected drafts; pass draft='ngram', a draft model without recurrent layers, "
            "or draft=None (--no-draft)"
        )


def settle_tree_budget(asked: int | None, drafter: DrafterSpec | None, cfg: ModelConfig) -> int:
    """`asked`, or when None DRAFT_WIDTH where draft trees can run, else 0 (chains). Trees are
    drafted by DFlash drafters and MTP heads, and not on a target with recurrent layers: a tree's rows
    branch, while a verify step runs a recurrent layer's rows as one chain (each row's state from
    the row before it), so asking for a tree there is refused."""
    if asked is None:
        return 0 if cfg.is_hybrid else DRAFT_WIDTH
    if asked and cfg.is_hybrid and drafter is not None and drafter.kind == "dflash":
        raise SpeculationUnsupportedError(
            f"tree_budget={asked}: draft trees on a model with recurrent (Gated DeltaNet) layers are not supported "
            "yet (a recurrent layer verifies one chain of rows, not a tree); pass tree_budget=0 (--tree-budget 0) "
            "or leave it unset for chains"
        )
    return asked


def graphs_possible(device: torch.device, backend: str, experts_on_host: bool) -> bool:
    """CUDA graphs run on CUDA with the Triton kernels (the torch reference MoE syncs with the host,
    which a graph cannot hold) and the experts on the device (an expert cache reads its choices).
    Recurrent layers graph too: their state slots follow from the step's positions."""
    return device.type == "cuda" and backend == "triton" and not experts_on_host


def use_cuda_graphs(asked: bool | None, device: torch.device, backend: str, expert_slots: int | None) -> bool:
    """`asked`, or wherever they can run when None; asking for them where they cannot is refused."""
    possible = graphs_possible(device, backend, expert_slots is not None)
    if asked and not possible:
        raise InvalidArgumentError("cuda_graphs=True needs device='cuda', the Triton kernels "
                                   "(backend='triton' or 'auto') and the experts on the device; this engine has "
                                   f"{device.type}, backend '{backend}'"
                                   + (", experts in host memory" if expert_slots is not None else ""))
    return possible if asked is None else asked


def plan_vram(config: EngineConfig, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str,
              quantization: str | None, drafter: DrafterSpec | None, stored: StoredWeights | None,
              lm_head: str | None = None) -> VramPlan:
    """The planner's choices under `config.vram_budget`, or InsufficientMemoryError saying what does
    not fit; on CUDA the allocator is held to the budget from here on."""
    context = config.max_context or cfg.max_position_embeddings
    prefill = config.prefill_chunk or PREFILL_CHUNK[device.type]
    cost = drafter_cost(drafter, dtype, context, prefill, config.draft_ctx, DRAFT_WIDTH)
    graphs = config.cuda_graphs is not False and graphs_possible(device, backend, False)
    asked = config.vram_budget
    outside = memory_outside_allocator(device) if device.type == "cuda" else 0
    if outside >= asked:
        raise InsufficientMemoryError(f"vram_budget={asked / 2**30:.1f}GiB: the CUDA context, loaded modules and "
                                      f"other processes already take {outside / 2**30:.1f} GiB of this card")
    config = config.replace(vram_budget=asked - outside)
    planned = plan_for_config(cfg, config, device.type, dtype, quantization, cost, graphs, stored, lm_head)
    if outside:
        planned.notes.insert(0, f"{outside / 2**30:.2f} GiB of the budget is outside torch's allocator (the CUDA "
                                "context, modules, other processes): the plan uses the rest")
    if not planned.fits:
        raise InsufficientMemoryError(f"vram_budget={asked / 2**30:.1f}GiB: {planned.notes[-1]}")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.vram_budget / total), device)
    return planned


def memory_choices(config: EngineConfig, cfg: ModelConfig, device: torch.device,
                   vram_plan: VramPlan | None) -> MemoryChoices:
    """Prefill chunk, pool and expert slots: the VRAM plan's, else the configuration's (the prefill
    chunk defaulting by device)."""
    if vram_plan is not None:
        c = vram_plan.choices
        slots = expert_slots_for(cfg, c["experts_on_host"], c["expert_slots"])
        return MemoryChoices(c["prefill_chunk"], c["kv_pool_tokens"], slots)
    slots = expert_slots_for(cfg, config.experts_on_host, config.expert_slots)
    return MemoryChoices(config.prefill_chunk or PREFILL_CHUNK[device.type], config.kv_pool_tokens, slots)


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


def plan_for_config(cfg: ModelConfig, config: EngineConfig, device_type: str, dtype: torch.dtype,
                    quantization: str | None, drafter: DrafterCost, graphs: bool,
                    stored_weights: StoredWeights | None = None, lm_head: str | None = None) -> VramPlan:
    """`plan_for_budget` for an engine configuration (its budget, context, policy, pool, prefill
    chunk, expert placement and KV dtype) and the chosen output head, on a device of `device_type`,
    whose default prefill chunk is the largest tried."""
    return plan_for_budget(cfg, config.vram_budget, config.max_context or cfg.max_position_embeddings, dtype,
                           quantization, drafter, config.kv_policy, config.kv_pool_tokens, config.prefill_chunk,
                           graphs, PREFILL_CHUNK[device_type], config.experts_on_host, config.expert_slots,
                           config.kv_int8, stored_weights, config.kv_reselect_every, lm_head, config.parallel)
