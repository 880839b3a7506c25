"""The memory planner under a VRAM budget: from a model's config alone, what a configuration puts
on the device, and what to shrink so that it fits.

Device parts: weights after quantization, sliding rings, the paged KV pool, KVFlash chunk
summaries at the full context (`select`), the drafter, activations of one prefill chunk and of
a verify step, and the CUDA graphs' pools (one per width). Host part: the KV that leaves the
pool, and the routed experts when they live in host memory. With a budget the planner keeps the
defaults while they fit and otherwise gives up, in order, prefill chunk size (down to 256 rows)
and pool size (down to what the policy needs): a smaller prefill chunk costs prefill speed, a
smaller pool long-context decode speed. If that is not enough for an MoE model (and experts in
host memory are allowed), it moves the routed experts to host memory and gives the device cache
of experts what is left at the default pool and prefill chunk (`lucebox.memory.expert_cache`): misses
cost PCIe copies, so this comes last. What still does not fit is named, with the largest context
that would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lucebox.caches import CacheSettings
from lucebox.caches.settings import STREAM_CHUNKS
from lucebox.config import ModelConfig
from lucebox.limits import DECODE_ROWS, KV_CHUNK, KV_RESELECT_EVERY, PREFILL_CHUNK
from lucebox.memory.lm_head import float_head_bytes, int8_head_bytes
from lucebox.memory.plan import DrafterCost, StoredWeights, plan, routed_expert_bytes

PREFILL_CHUNKS = (2048, 1024, 512, 256)  # tried largest first, from the device's default (PREFILL_CHUNK)


def activation_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """Peak activations of one forward of `rows` rows: the residual stream and its norms, q/k/v and
    the attention output, the MLP or routed experts' hidden (gate and up) for every chosen expert,
    and float32 logits for up to DECODE_ROWS rows. An estimate, not a measurement: it leaves out
    the allocator's rounding, which the budget's headroom covers."""
    size = dtype.itemsize
    heads = max(layer.num_heads for layer in cfg.layers)
    attention = rows * (2 * heads + 2 * cfg.num_kv_heads) * cfg.head_dim * size + merge_bytes(cfg, rows, dtype)
    if cfg.moe is not None:
        mlp = rows * cfg.moe.top_k * 3 * cfg.moe.expert_size * 4  # float32 accumulation in the fused kernel
    else:
        mlp = rows * 3 * cfg.intermediate_size * size
    residual = rows * 4 * cfg.hidden_size * 4
    logits = min(rows, DECODE_ROWS) * cfg.vocab_size * 4
    return attention + mlp + residual + logits


def merge_bytes(cfg: ModelConfig, rows: int, dtype: torch.dtype) -> int:
    """What attention over several key blocks (a long prefill: the pool, then runs of chunks
    streamed from the host) holds beside q/k/v and its output, whatever the context: the running
    log-sum-exp merge's float32 accumulator, one block's partial (float32 as the kernel writes it,
    then cast to `dtype`), their log-sum-exps, and one streamed run of K/V
    (`kernels.attention.merge_partials`; measured in tests/test_host_path.py)."""
    heads = max(layer.num_heads for layer in cfg.layers)
    partials = rows * heads * (cfg.head_dim * (4 + 4 + dtype.itemsize) + 3 * 4)
    return partials + STREAM_CHUNKS * KV_CHUNK * cfg.kv_bytes_per_token(dtype.itemsize)


def graph_pool_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The one memory pool every captured step graph shares (`lucebox.engine.runner`): graphs replay
    one at a time, so one set of activations, the widest step's, serves them all; each graph's
    outputs (its logits) stay allocated between replays."""
    kept_logits = sum(width * cfg.vocab_size * 4 for width in range(1, DECODE_ROWS))
    return activation_bytes(cfg, DECODE_ROWS, dtype) + kept_logits


@dataclass
class VramPlan:
    fits: bool
    budget: int
    device: dict[str, int]  # bytes of each device part
    host: dict[str, int]
    choices: dict  # what the planner settled on: kv_pool_tokens, prefill_chunk, kv_policy, max_context
    notes: list[str] = field(default_factory=list)  # what it gave up, or why it cannot fit

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    def lines(self) -> list[str]:
        """The plan as text: the verdict, each part, the choices and the notes."""
        gib, c = 2**30, self.choices
        verdict = "fits" if self.fits else "does not fit"
        weights = c["quantization"] or c["dtype"]
        sequences = f" x {c['parallel']} sequences at once" if c.get("parallel", 1) > 1 else ""
        lines = [f"VRAM plan for {c['max_context']} tokens{sequences}, {weights} weights: "
                 f"{self.device_total / gib:.2f} of {self.budget / gib:.2f} GiB, {verdict}"]
        lines += [f"  {part:<20} {size / gib:8.2f} GiB" for part, size in self.device.items()]
        lines.append(f"  host KV (at most)    {self.host['kv_host'] / gib:8.2f} GiB")
        if self.host["experts_host"]:
            lines.append(f"  experts in host      {self.host['experts_host'] / gib:8.2f} GiB")
        slots = f", expert_slots {c['expert_slots']}" if c["experts_on_host"] else ""
        lines.append(f"  chosen: kv_policy {c['kv_policy']}, kv_pool_tokens {c['kv_pool_tokens']}, "
                     f"prefill_chunk {c['prefill_chunk']}, kv_dtype {c['kv_dtype']}{slots}, lm_head {c['lm_head']} "
                     f"({c['lm_head_bytes_per_token'] / 2**20:.1f} MiB read per token)")
        return lines + [f"  {note}" for note in self.notes]

    def as_json(self) -> dict:
        return {"fits": self.fits, "budget_bytes": self.budget, "device_total_bytes": self.device_total,
                "device_bytes": self.device, "host_bytes": self.host, "choices": self.choices, "notes": self.notes}


def _min_pool(prefill: int, policy: str | None, max_context: int, reselect: int) -> int:
    """The smallest pool the engine accepts for this prefill chunk and policy (with no policy
    given, a pool smaller than the context means `select`)."""
    def need(p: str) -> int:
        settings = CacheSettings.for_engine(max_context, prefill, p, KV_CHUNK, reselect)
        return settings.kvflash().min_pool_chunks * KV_CHUNK

    if policy is not None:
        return need(policy)
    rounded = -(-max_context // KV_CHUNK) * KV_CHUNK
    return min(max(rounded, need("exact")), need("select"))


def _parts(cfg, settings, dtype, quantization, drafter, graphs: bool, slots: int | None = None,
           stored: StoredWeights | None = None, lm_head: str | None = None, sequences: int = 1) -> tuple[dict, dict]:
    need = plan(cfg, settings, dtype, quantization, drafter, slots, stored, lm_head, sequences)
    cache = 0 if slots is None else slots * _routed_bytes(cfg, dtype, quantization, stored) // cfg.moe.num_experts
    device = {
        "weights": need["weights"] - cache,
        "expert_cache": cache,
        "ring_caches": need["ring_caches"],
        "kv_pool": need["kv_pool_device"],
        "kv_chunk_summaries": need["kv_chunk_summaries_max"],
        "drafter": need["drafter"],
        "activations": activation_bytes(cfg, max(settings.max_step, DECODE_ROWS), dtype),
        "graph_pools": graph_pool_bytes(cfg, dtype) if graphs else 0,
    }
    return device, {"kv_host": need["kv_host_max"], "experts_host": need["experts_host"]}


@dataclass(frozen=True)
class _Request:
    """What a plan is for; the planner varies pool, prefill chunk and expert slots around it."""

    cfg: ModelConfig
    budget: int
    max_context: int
    dtype: torch.dtype
    quantization: str | None
    drafter: DrafterCost
    kv_policy: str | None
    kv_int8: bool
    kv_reselect_every: int
    stored: StoredWeights | None  # the weights as a GGUF file fixes them, else from the config
    lm_head: str | None = None  # "int8": the output head as int8 codes (`lucebox.memory.lm_head`)
    sequences: int = 1  # run at once, a slot's caches each (`EngineConfig.parallel`)

    @property
    def routed_expert_bytes(self) -> int:
        return _routed_bytes(self.cfg, self.dtype, self.quantization, self.stored)

    def at(self, pool: int, prefill: int, graphs: bool, slots: int | None = None) -> VramPlan:
        """The plan at this pool and prefill chunk (and with `slots`, experts in host memory)."""
        settings = CacheSettings.for_engine(self.max_context, prefill, self.kv_policy, pool, self.kv_reselect_every,
                                            kv_int8=self.kv_int8)
        device, host = _parts(self.cfg, settings, self.dtype, self.quantization, self.drafter,
                              graphs and slots is None, slots, self.stored, self.lm_head, self.sequences)
        choices = {"kv_pool_tokens": pool, "prefill_chunk": prefill, "kv_policy": settings.kv_policy,
                   "max_context": self.max_context,
                   "quantization": "gguf" if self.stored is not None else self.quantization,  # the file's blocks
                   "dtype": str(self.dtype).split(".")[-1], "kv_dtype": "int8" if self.kv_int8 else "auto",
                   "experts_on_host": slots is not None, "expert_slots": slots, "lm_head": self.lm_head or "float",
                   "parallel": self.sequences,
                   "lm_head_bytes_per_token": int8_head_bytes(self.cfg) if self.lm_head
                   else float_head_bytes(self.cfg, self.dtype)}
        return VramPlan(sum(device.values()) <= self.budget, self.budget, device, host, choices)

    def why_not(self, best: VramPlan) -> VramPlan:
        best.notes.append(_why_not(best, self.routed_expert_bytes, self.quantization))
        return best


def plan_for_budget(cfg: ModelConfig, budget: int, max_context: int, dtype: torch.dtype,
                    quantization: str | None = None, drafter: DrafterCost | None = None,
                    kv_policy: str | None = None, kv_pool_tokens: int | None = None,
                    prefill_chunk: int | None = None, graphs: bool = True,
                    largest_prefill: int = PREFILL_CHUNK["cuda"], experts_on_host: bool | None = None,
                    expert_slots: int | None = None, kv_int8: bool = False,
                    stored_weights: StoredWeights | None = None,
                    kv_reselect_every: int = KV_RESELECT_EVERY, lm_head: str | None = None,
                    sequences: int = 1) -> VramPlan:
    """The plan under `budget` device bytes. Values the caller gives are kept; the planner
    chooses the others from the defaults down: the prefill chunk first (from `largest_prefill`,
    the device's default), then the pool, then (`experts_on_host` None: when nothing else fits;
    True: always) the routed experts go to host memory with as many device slots per layer as fit
    (or `expert_slots`). Experts in host memory make steps eager: `graphs` is then ignored.
    `stored_weights`: the weights' bytes when the checkpoint fixes them (a GGUF file's blocks).
    `lm_head`: "int8" for an int8 output head (`lucebox.memory.lm_head.choose_lm_head`). `sequences`:
    how many run at once, each slot's caches counted (`EngineConfig.parallel`)."""
    request = _Request(cfg, budget, max_context, dtype, quantization, drafter or DrafterCost(), kv_policy, kv_int8,
                       kv_reselect_every, stored_weights, lm_head, sequences)
    prefills = [prefill_chunk] if prefill_chunk else [p for p in PREFILL_CHUNKS if p <= largest_prefill]
    pools = [kv_pool_tokens] if kv_pool_tokens else _pool_sizes(prefills[-1], kv_policy, max_context, kv_reselect_every)
    # A pool must hold what one prefill chunk writes: pairs the engine would refuse are skipped
    # (unless nothing else is left, and then the engine's own check names the problem).
    pairs = [(pool, prefill) for pool in pools for prefill in prefills
             if pool >= _min_pool(prefill, kv_policy, max_context, kv_reselect_every)] or [(pools[-1], prefills[-1])]
    first = (prefills[0], pools[0])
    if experts_on_host and cfg.moe is not None:
        return _with_experts_on_host(request, pairs, expert_slots, first)
    best = None
    for pool, prefill in pairs:  # the pool is what keeps long-context decoding fast: it gives way last
        candidate = request.at(pool, prefill, graphs)
        if candidate.fits:
            return _explain_choices(candidate, *first)
        best = candidate if best is None or candidate.device_total < best.device_total else best
    if experts_on_host is None and cfg.moe is not None:  # the last resort; if it fails too, it says why
        return _with_experts_on_host(request, pairs, expert_slots, first)
    return request.why_not(best)


def _with_experts_on_host(request: _Request, pairs: list, slots: int | None, first: tuple[int, int]) -> VramPlan:
    """The routed experts in host memory, and the most device slots per MoE layer that fit (at
    least `top_k`, what one row chooses), at the largest pool and prefill chunk that leave room."""
    cfg = request.cfg
    per_slot = request.routed_expert_bytes // cfg.moe.num_experts  # one expert of every MoE layer
    best = None
    for pool, prefill in pairs:
        room = min(cfg.moe.num_experts, (request.budget - request.at(pool, prefill, False, 0).device_total) // per_slot)
        chosen = slots or max(int(room), cfg.moe.top_k)
        candidate = request.at(pool, prefill, False, chosen)
        if candidate.fits:
            moved = request.routed_expert_bytes / 2**30
            candidate.notes.append(f"routed experts ({moved:.1f} GiB) moved to host memory; the device caches "
                                   f"{chosen} of each MoE layer's {cfg.moe.num_experts} experts; steps run eagerly, "
                                   "not as CUDA graphs")
            return _explain_choices(candidate, *first)
        best = candidate if best is None or candidate.device_total < best.device_total else best
    return request.why_not(best)


def _pool_sizes(prefill: int, policy: str | None, max_context: int, reselect: int) -> list[int]:
    """The engine's default pool first, then halvings down to the minimum."""
    minimum = _min_pool(prefill, policy, max_context, reselect)
    pool = max(CacheSettings.for_engine(max_context, prefill, policy).kv_pool_tokens, minimum)
    sizes = [pool]
    while pool // 2 >= minimum:
        pool = pool // 2 // KV_CHUNK * KV_CHUNK
        sizes.append(pool)
    if sizes[-1] != minimum:
        sizes.append(minimum)
    return sizes


def _explain_choices(plan_: VramPlan, first_prefill: int, first_pool: int) -> VramPlan:
    c = plan_.choices
    if c["kv_pool_tokens"] != first_pool:
        plan_.notes.append(f"KV pool lowered from {first_pool} to {c['kv_pool_tokens']} tokens to fit the budget")
    if c["prefill_chunk"] != first_prefill:
        plan_.notes.append(f"prefill chunk lowered from {first_prefill} to {c['prefill_chunk']} rows to fit the budget")
    return plan_


def _why_not(best: VramPlan, experts: int, quantization: str | None) -> str:
    d, gib = best.device, 2**30
    fixed = d["weights"] + d["expert_cache"] + d["drafter"]
    if fixed > best.budget:
        if best.choices["experts_on_host"]:
            more = (f" even with the routed experts ({experts / gib:.1f} GiB) in host memory and "
                    f"{best.choices['expert_slots']} per layer cached on the device")
        else:
            more = (f"; the routed experts are {experts / gib:.1f} GiB of it, which experts_on_host would move "
                    "to host memory") if experts else ""
        hint = "" if quantization == "int4" else ", or quantization='int4'"
        return (f"does not fit: the weights alone need {fixed / gib:.1f} GiB of the {best.budget / gib:.1f} GiB "
                f"budget{more}{hint}")
    summaries_per_token = d["kv_chunk_summaries"] / max(best.choices["max_context"], 1)
    spare = best.budget - (best.device_total - d["kv_chunk_summaries"])
    largest = int(spare // summaries_per_token) // KV_CHUNK * KV_CHUNK if summaries_per_token else 0
    context = f"; the largest context that fits is about {largest} tokens" if largest >= KV_CHUNK else ""
    return (f"does not fit: {best.device_total / gib:.1f} GiB on the device at the smallest pool and prefill "
            f"chunk, over the {best.budget / gib:.1f} GiB budget{context}")


def _routed_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str | None, stored: StoredWeights | None) -> int:
    """Bytes of the routed experts of every layer, as stored or as the engine would quantize them."""
    return stored.routed_experts if stored is not None else routed_expert_bytes(cfg, dtype, quantization)
