"""The engine's limits and defaults, each defined once: every other module imports them from here.

Limits are sizes the engine is built around; defaults are what a setting takes when the caller
gives none (the CLI, the server, `bench` and the planner all read them from here).
"""

from __future__ import annotations

# The most rows one decode or verify step forwards: the last token plus up to DRAFT_WIDTH drafts.
# Rings, the paged pool, CUDA graphs (one per width) and the speculation stage's statistics are
# sized by it. Kernels choose their own tile sizes (`kernels.moe.SMALL_STEP_ROWS`,
# `kernels.moe_triton.DEDUP_ROWS`), which a test holds at or above it.
DECODE_ROWS = 16
# Drafters are built for the widest round a verify step holds; `draft_k` caps each round, and can
# change between requests.
DRAFT_WIDTH = DECODE_ROWS - 1
# Full-attention K/V moves in chunks of this many positions: the paged pool's page, the unit KVFlash
# offloads, streams and selects, and the granularity of context sizes.
KV_CHUNK = 64

# Defaults of the engine's settings (`LLM(...)` keyword arguments and the CLI's engine flags).
PREFILL_CHUNK = {"cuda": 2048, "cpu": 512}  # rows per prefill forward, by device type
KV_POOL_TOKENS = 8192  # the device KV pool of each full-attention layer, at most (less for a short context)
KV_RESELECT_EVERY = 64  # committed tokens between KVFlash `select` re-selections
SELECT_TAIL_TOKENS = 256  # `select` always attends to at least this many recent positions
DRAFT_CTX = 4096  # tokens of context a drafter keeps (its ring)
