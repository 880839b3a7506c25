"""The engine's one configuration: every argument checked, every default defined once.

`EngineConfig` is what the caller asked for: `LLM(...)`'s keyword arguments, the CLI's engine flags
(`engine_flags.engine_config`), the server's and `bench`'s, all checked here for type and
range. What depends on the machine or the model (the device, the prefill chunk, whether CUDA
graphs run, the memory plan) is settled from it by `engine.setup`. The limits and defaults it
checks against are in `lucebox.limits`, where the layers below the engine read them too.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from lucebox.arguments import choice, flag, integer, path, size
from lucebox.limits import (
    BACKENDS,
    DRAFT_CTX,
    DRAFT_WIDTH,
    KV_DTYPES,
    KV_POLICIES,
    KV_RESELECT_EVERY,
    LM_HEADS,
    LOAD_FORMATS,
    PARALLEL_MAX,
    VERIFY_RULES,
)


@dataclass(frozen=True)
class EngineConfig:
    """How to open and run a model. None means "decided from the device and the model" where a
    field says so; every other default is a constant of `lucebox.limits`.

    model: a Hugging Face folder, a config.json, a .gguf file, the built-in model's name
        (`laguna-code-6m`) or None (the built-in model).
    draft: speculative decoding: "auto" (the model's paired drafter if one ships with it, else its
        own MTP head if it has one, else none; the default), None (off), "ngram" (prompt lookup),
        "mtp" (the model's MTP head), or a drafter folder (DFlash, or a smaller model sharing the
        vocabulary). The output is the target's own either way.
    device, dtype: "auto" is CUDA when present (bfloat16), else the CPU (float32).
    load_format: "auto" | "safetensors" | "dummy" (random weights at the real shapes).
    max_context: most prompt + generated tokens of one sequence (None: the model's
        max_position_embeddings; more gets a warning).
    kv_policy: what a decode step attends to: "exact" (everything; None picks it when the whole
        context fits the pool) or "select" (sink + recent tail + the chunks that score highest).
    kv_pool_tokens: full-attention K/V kept on the device per layer (None: the context, at most
        KV_POOL_TOKENS); the rest lives in host memory.
    kv_reselect_every: committed tokens between `select` re-selections.
    prefill_chunk: rows per prefill forward (None: PREFILL_CHUNK of the device).
    draft_k: most drafts per round (the width adapts below it); draft_ctx: the drafter's ring.
    verify: how sampled rounds are verified, each keeping the target's distribution: "coupled"
        (target and drafter race against one noise keyed by seed and position, so a seeded request
        commits the tokens plain decoding would), "tokenwise" or "block" (drawn outcomes).
    adaptive: choose each round's width by cost (False: always draft_k, never switched off).
    tree_budget: most draft rows of a draft tree per round (a DFlash drafter's or an MTP head's
        top-k per position, best first): greedy rounds verify the rows the width policy finds worth
        their cost (all of them when `adaptive` is False, sampled rounds too); 0: chains; None:
        DRAFT_WIDTH where trees can run (a target without recurrent layers), else chains.
    backend: kernels: "auto" (Triton on CUDA, the torch references on the CPU) | "triton" | "torch".
    quantization: "int8" | "int4": quantize the linear layers' weights as they load.
    cuda_graphs: run decode/verify steps as CUDA graphs (None: wherever they can run).
    vram_budget: plan device memory within this many bytes ("24GiB", or an int).
    experts_on_host: keep routed experts in host memory behind a device cache (None: only when the
        budget needs it); expert_slots: that cache's experts per layer (giving it implies True).
    kv_dtype: "auto" (the model dtype) | "int8" (the pool's rows as int8 with per-token scales).
    lm_head: "auto" (int8 codes with per-row scales for quantized weights where the kernels read
        codes, else the float head) | "float" (keep the float head) | "int8" (codes regardless).
    parallel: sequences that run at once, each in a slot with its own cache and drafter (the memory
        plan counts every slot); the steps of those running together share one forward. A request
        beyond them runs in a cache and drafter of its own (`LLM`), or waits (`serve`).
    """

    model: str | os.PathLike | None = None
    draft: str | os.PathLike | None = "auto"
    device: Any = "auto"
    dtype: Any = "auto"
    load_format: str = "auto"
    max_context: int | None = None
    kv_policy: str | None = None
    kv_pool_tokens: int | None = None
    kv_reselect_every: int = KV_RESELECT_EVERY
    prefill_chunk: int | None = None
    draft_k: int = DRAFT_WIDTH
    verify: str = "coupled"
    draft_ctx: int = DRAFT_CTX
    adaptive: bool = True
    tree_budget: int | None = None
    backend: str = "auto"
    quantization: str | None = None
    cuda_graphs: bool | None = None
    vram_budget: str | int | None = None
    experts_on_host: bool | None = None
    expert_slots: int | None = None
    kv_dtype: str = "auto"
    lm_head: str = "auto"
    parallel: int = 1

    def __post_init__(self) -> None:
        checked = {
            "model": path("model", self.model, optional=True),
            "draft": None if self.draft == "none" else path("draft", self.draft, optional=True),  # as --draft none
            "load_format": choice("load_format", self.load_format, LOAD_FORMATS),
            "max_context": integer("max_context", self.max_context, 1, optional=True),
            "kv_policy": choice("kv_policy", self.kv_policy, KV_POLICIES, optional=True),
            "kv_pool_tokens": integer("kv_pool_tokens", self.kv_pool_tokens, 1, optional=True),
            "kv_reselect_every": integer("kv_reselect_every", self.kv_reselect_every, 1),
            "prefill_chunk": integer("prefill_chunk", self.prefill_chunk, 1, optional=True),
            "draft_k": integer("draft_k", self.draft_k, 1, DRAFT_WIDTH),
            "verify": choice("verify", self.verify, VERIFY_RULES),
            "draft_ctx": integer("draft_ctx", self.draft_ctx, 1),
            "adaptive": flag("adaptive", self.adaptive),
            "tree_budget": integer("tree_budget", self.tree_budget, 0, DRAFT_WIDTH, optional=True),
            "backend": choice("backend", self.backend, BACKENDS),
            "cuda_graphs": flag("cuda_graphs", self.cuda_graphs, optional=True),
            "vram_budget": None if self.vram_budget is None else size("vram_budget", self.vram_budget),
            "experts_on_host": flag("experts_on_host", self.experts_on_host, optional=True),
            "expert_slots": integer("expert_slots", self.expert_slots, 1, optional=True),
            "kv_dtype": choice("kv_dtype", "auto" if self.kv_dtype is None else self.kv_dtype, KV_DTYPES),
            "lm_head": choice("lm_head", self.lm_head, LM_HEADS),
            "parallel": integer("parallel", self.parallel, 1, PARALLEL_MAX),
        }
        if checked["expert_slots"] is not None and checked["experts_on_host"] is None:
            checked["experts_on_host"] = True  # asking for a cache size asks for the cache
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: the documented way to normalize in __post_init__

    def replace(self, **changes) -> EngineConfig:
        """This configuration with `changes` (checked like the rest)."""
        return dataclasses.replace(self, **changes)

    @property
    def kv_int8(self) -> bool:
        return self.kv_dtype == "int8"
