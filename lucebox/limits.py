"""The sizes lucebox is built around and the words its settings take, each defined once. A leaf:
it imports nothing of lucebox's, so every layer (kernels, caches, models, the planner, the
drafters, the engine's configuration) reads its limits from here."""

# The most rows one decode or verify step forwards: the last token plus up to DRAFT_WIDTH drafts.
# Rings, the paged pool, CUDA graphs (one per width) and the speculation stage's statistics are
# sized by it, and the decode kernels (the streaming GEMV, the MoE decode layout, the Triton routing)
# take their widest specialization from it, so raising it cannot leave one on a slower path
# unnoticed. Kernels with tile sizes of their own (`kernels.moe.SMALL_STEP_ROWS`) are held at or
# above it by a test.
DECODE_ROWS = 16
# Most sequences an engine runs at once (`EngineConfig.parallel`; `lucebox serve --parallel`, 4 by
# default): each slot holds a cache of its own, so the memory plan grows with them.
PARALLEL_MAX = 64
SERVE_PARALLEL = 4
# Drafters are built for the widest round a verify step holds; `draft_k` caps each round, and can
# change between requests.
DRAFT_WIDTH = DECODE_ROWS - 1
# Full-attention K/V moves in chunks of this many positions: the paged pool's page, the unit KVFlash
# offloads, streams and selects, and the granularity of context sizes.
KV_CHUNK = 64

# Defaults of settings whose default depends on nothing else.
PREFILL_CHUNK = {"cuda": 2048, "cpu": 512}  # rows per prefill forward, by device type
KV_POOL_TOKENS = 8192  # the device KV pool of each full-attention layer, at most (less for a short context)
KV_RESELECT_EVERY = 64  # committed tokens between KVFlash `select` re-selections
SELECT_TAIL_TOKENS = 256  # `select` always attends to at least this many recent positions
DRAFT_CTX = 4096  # tokens of context a drafter keeps (its ring)

# The words some settings take.
KV_POLICIES = ("exact", "select")
VERIFY_RULES = ("coupled", "tokenwise", "block")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
BACKENDS = ("auto", "torch", "triton")
KV_DTYPES = ("auto", "int8")
LM_HEADS = ("auto", "float", "int8")  # the output head: the planner's choice, the float table, int8 codes
