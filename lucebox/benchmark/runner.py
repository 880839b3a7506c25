"""The measurements behind `lucebox bench`: one row per context depth.

Each request prefills a `depth`-token prompt from an empty cache and decodes `gen` tokens. At
every depth the plain and the speculative engine take turns, repeat after repeat, so a drift in
the machine's speed hits both alike and their ratio stays honest.

Plain and speculative decoding run on one engine (one copy of the weights): its plain requests
pass `speculate=False`, which leaves the drafter out of that request.
"""

from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lucebox.benchmark.progress import LineProgress
from lucebox.engine.config import EngineConfig
from lucebox.errors import ContextLengthError, InsufficientMemoryError, InvalidArgumentError

LADDER = (1024, 4096, 16384, 65536, 262144)
# A prompt file is read whole before tokenizing: 64 MiB is ~16M tokens of text at ~4 bytes a token,
# far past the deepest ladder depth (256K), and keeps a stray file (a disk image, /dev/zero) out.
MAX_PROMPT_FILE_BYTES = 64 * 2**20
# Tokenize no more of the text than `depth` tokens can span: a token of code or prose is a few
# characters, rarely 16; text beyond that would be cut off after tokenizing anyway.
MOST_CHARS_PER_TOKEN = 16
CPU_DEFAULT_DEEPEST = 16384  # prefill on a CPU runs at hundreds of tokens/s at 16K: deeper takes hours
WARMUP_TOKENS = 64


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. `depths=None` is the default ladder, cut to what fits this machine's memory."""

    depths: tuple[int, ...] | None = None
    gen: int = 128
    repeat: int = 3
    prompt_file: Path | None = None
    prompt_text: str | None = None  # the prompt file's text, read early (`read_prompt_file`); None: read it here
    prompt: str = "auto"  # without a prompt file: "code", "random", or "auto" (code when there is a tokenizer)
    seed: int = 0


def run_benchmark(engine: EngineConfig, settings: BenchSettings, progress: LineProgress | None = None) -> dict:
    """Rows of figures by depth, plus the model and the settings that produced them. With a
    `draft`, each depth is measured plain and speculative (None: plain only)."""
    progress = progress or LineProgress()
    depths, plain = _open_engine(engine, settings)
    spec = plain if plain.proposer is not None else None
    body = _prompt_body(plain, settings, depths[-1])
    prompts = _Prompts(body, plain.config.vocab_size)
    modes = "plain only" if spec is None else f"plain and speculative ({_drafter(plain, engine.draft)})"
    progress.start(f"{_model_record(plain)['name']}: depths {', '.join(map(str, depths))}, {modes}, "
                   f"{settings.repeat} x {settings.gen} tokens each", len(depths))
    for speculate in (False, True) if spec is not None else (False,):
        # first-request costs (allocations, CUDA graphs of each width) stay out of the rows
        plain.generate(prompts.take(min(WARMUP_TOKENS, depths[-1])), max_tokens=settings.gen, ignore_eos=True,
                       speculate=speculate)
    rows = [_measure_depth(depth, plain, spec, prompts, settings, progress) for depth in depths]
    return {"model": _model_record(plain), "settings": _settings_record(plain, spec, engine, settings, depths),
            "memory": {"weights_bytes": plain.memory()["weights"],
                       "drafter_bytes": spec.memory()["drafter"] if spec is not None else 0,
                       "peak_memory": _peak_kind(plain.device)},
            "rows": rows}


def _open_engine(engine: EngineConfig, settings: BenchSettings):
    """The engine, opened for the deepest depth. Default depths drop from the deepest until it fits;
    depths asked for fail if they do not fit."""
    from lucebox import LLM
    from lucebox.device import resolve_device

    explicit = settings.depths is not None
    if explicit:
        depths = sorted(settings.depths)
    else:
        deepest = CPU_DEFAULT_DEEPEST if resolve_device(engine.device).type == "cpu" else LADDER[-1]
        depths = [d for d in LADDER if d <= deepest]
    ctx = engine.max_context
    if ctx is not None:
        too_deep = [d for d in depths if d + settings.gen > ctx]
        if too_deep and explicit:
            raise InvalidArgumentError(f"depth {too_deep[0]} + --gen {settings.gen} is more than --ctx {ctx}")
        depths = [d for d in depths if d + settings.gen <= ctx]
        if not depths:
            raise InvalidArgumentError(f"--ctx {ctx} leaves no room for the shallowest depth + --gen {settings.gen}")
    while True:
        try:
            return depths, LLM.from_config(engine.replace(max_context=ctx or depths[-1] + settings.gen))
        except (ContextLengthError, InsufficientMemoryError):  # the KV pool grows with the context too
            if explicit or len(depths) == 1:
                raise
            depths = depths[:-1]


def prompt_kind(llm, settings: BenchSettings) -> str:
    """"file", "code" or "random": what the prompts are cut from."""
    if settings.prompt_file is not None:
        return "file"
    if settings.prompt == "auto":
        return "code" if llm.tokenizer is not None else "random"
    return settings.prompt


def _prompt_body(llm, settings: BenchSettings, length: int) -> list[int]:
    """`length` token ids: random (seeded); the held-out standard-library modules one after the
    other (what a code model reads: text it has not seen, no repeats for a drafter to copy); or the
    prompt file's text tiled."""
    kind = prompt_kind(llm, settings)
    if kind == "random":
        generator = torch.Generator().manual_seed(settings.seed)
        return torch.randint(0, llm.config.vocab_size, (length,), generator=generator).tolist()
    if kind == "code":
        from lucebox.training.corpus import read_texts, stdlib_files

        text = "\n\n".join(read_texts(stdlib_files("held_out")))
        where = "the held-out standard-library modules"
    else:
        text = settings.prompt_text if settings.prompt_text is not None else read_prompt_file(settings.prompt_file)
        where = f"--prompt-file {settings.prompt_file}"
    if llm.tokenizer is None:
        raise InvalidArgumentError(f"{where}: the model has no tokenizer to encode it; use --prompt random")
    # no BOS: tiled, it would recur at every seam (and the first token is replaced per request anyway)
    ids = llm.tokenizer.encode(text[:length * MOST_CHARS_PER_TOKEN], add_special_tokens=False)
    if not ids:
        raise InvalidArgumentError(f"{where} holds no text to tile: it encodes to no tokens")
    return (ids * -(-length // len(ids)))[:length]


def read_prompt_file(path: str | Path) -> str:
    """The text of a --prompt-file: a regular file of at most MAX_PROMPT_FILE_BYTES, holding more than
    white space (an empty text would tile nothing), read before any model is loaded."""
    from lucebox.bounded_json import read_regular_file

    text = read_regular_file(path, "--prompt-file", MAX_PROMPT_FILE_BYTES).decode("utf-8", errors="replace")
    if not text.strip():
        raise InvalidArgumentError(f"--prompt-file {str(path)!r} holds no text to tile (it is empty or only "
                                   "white space)")
    return text


class _Prompts:
    """Prompts cut from one body. Each request's first token differs from the one before, so no
    request reuses the previous request's cache: every prefill starts from an empty cache."""

    def __init__(self, body: list[int], vocab: int):
        self.body, self.vocab, self.count = body, vocab, 0

    def take(self, depth: int) -> list[int]:
        self.count += 1
        return [(self.body[0] + self.count) % self.vocab, *self.body[1:depth]]


def _request(llm, prompt: list[int], gen: int, label: str, progress: LineProgress) -> dict:
    progress.prefill(label, len(prompt))
    last = None
    for chunk in llm.stream(prompt, max_tokens=gen, ignore_eos=True, speculate=label == "spec"):
        if last is None:
            progress.decoding(gen)
        progress.advance(len(chunk.token_ids))
        last = chunk
    return last.stats


def _measure_depth(depth: int, plain, spec, prompts: _Prompts, settings: BenchSettings,
                   progress: LineProgress) -> dict:
    engines = {"plain": plain} if spec is None else {"plain": plain, "spec": spec}
    samples: dict[str, list[dict]] = {name: [] for name in engines}
    progress.row(depth, settings.repeat * len(engines))
    _reset_peak(plain.device)
    for r in range(settings.repeat):
        for name, llm in engines.items():
            stats = _request(llm, prompts.take(depth), settings.gen, name, progress)
            samples[name].append(stats)
            accept = f", acceptance length {stats['acceptance_length']:.2f}" if name == "spec" else ""
            progress.request_done(f"depth {depth} {name} {r + 1}/{settings.repeat}: prefill "
                                  f"{stats['prefill_tokens_per_s']:.0f} tok/s, decode "
                                  f"{stats['decode_tokens_per_s']:.1f} tok/s{accept}")
    memory = plain.memory()  # its cache holds this depth's last request
    row = {"depth": depth,
           **_spread("prefill_tokens_per_s", [s["prefill_tokens_per_s"] for s in samples["plain"]]),
           **_spread("decode_tokens_per_s", [s["decode_tokens_per_s"] for s in samples["plain"]])}
    if spec is not None:
        rates = [s["decode_tokens_per_s"] for s in samples["spec"]]
        rounds = sum(sum(s["width_histogram"].values()) for s in samples["spec"])
        drafted = sum(k * n for s in samples["spec"] for k, n in s["width_histogram"].items())
        row.update(_spread("spec_decode_tokens_per_s", rates))
        # Each repeat's pair ran back to back: the median of their ratios shrugs off a drift that
        # slowed one repeat, where a ratio of medians would not.
        row["spec_speedup"] = statistics.median(s["decode_tokens_per_s"] / p["decode_tokens_per_s"]
                                                for s, p in zip(samples["spec"], samples["plain"], strict=True))
        row["acceptance_length"] = statistics.median(s["acceptance_length"] for s in samples["spec"])
        row["drafts_per_round"] = drafted / rounds  # below draft_k when the adaptive width drafts less
    else:
        row.update(_spread("spec_decode_tokens_per_s", None))
        row.update(spec_speedup=None, acceptance_length=None, drafts_per_round=None)
    row["kv_device_bytes"] = memory["ring_caches"] + memory["kv_pool_device"] + memory["kv_chunk_summaries"]
    row["kv_host_bytes"] = memory["kv_host"]
    row["peak_memory_bytes"] = _peak_bytes(plain.device)
    spec_line = (f", speculative {row['spec_decode_tokens_per_s']:.1f} tok/s (x{row['spec_speedup']:.2f}, "
                 f"acceptance length {row['acceptance_length']:.2f})" if spec is not None else "")
    progress.row_done(f"depth {depth}: prefill {row['prefill_tokens_per_s']:.0f} tok/s, decode "
                      f"{row['decode_tokens_per_s']:.1f} tok/s{spec_line}")
    return row


def _spread(name: str, values: list[float] | None) -> dict:
    if values is None:
        return {name: None, f"{name}_min": None, f"{name}_max": None}
    return {name: statistics.median(values), f"{name}_min": min(values), f"{name}_max": max(values)}


def _peak_kind(device: torch.device) -> str:
    """Where peak memory comes from: the CUDA allocator's peak (reset every row), or on the CPU the
    process's peak resident set, which only grows (so a row shows the peak up to that depth)."""
    return "cuda_max_memory_allocated" if device.type == "cuda" else "process_peak_rss"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _model_record(llm) -> dict:
    from lucebox.builtin import BUILTIN_MODEL, BUILTIN_NAME
    from lucebox.models.layout import parameter_counts

    folder = llm.description.folder
    builtin = folder.resolve() == BUILTIN_MODEL.resolve()
    total, active = parameter_counts(llm.config)
    return {"name": BUILTIN_NAME + " (built-in)" if builtin else folder.name, "path": str(folder),
            "architecture": llm.config.architecture, "parameters_total": total, "parameters_active": active}


def _drafter(plain, draft) -> str:
    """The drafter `draft` names: "auto" resolves to the folder shipped with the model."""
    if draft != "auto":
        return str(draft)
    from lucebox.speculative.drafters import paired_drafter

    return str(paired_drafter(plain.description.folder))


def _settings_record(plain, spec, engine: EngineConfig, settings: BenchSettings, depths: list[int]) -> dict:
    drafter = _drafter(plain, engine.draft) if spec is not None else None
    cache, setup = plain.setup.cache, plain.setup
    return {
        "depths": depths, "gen": settings.gen, "repeat": settings.repeat, "seed": settings.seed,
        "prompt": {"file": f"file {settings.prompt_file}, tiled", "random": "random token ids",
                   "code": "held-out standard-library modules, concatenated"}[prompt_kind(plain, settings)],
        "device": str(plain.device), "dtype": str(plain.dtype).removeprefix("torch."), "backend": setup.backend,
        "quantization": setup.quantization, "max_context": plain.max_context, "prefill_chunk": setup.prefill_chunk,
        "kv_policy": cache.kv_policy, "kv_pool_tokens": cache.kv_pool_tokens,
        "cuda_graphs": plain.engine.runner.graphs,
        "draft": None if engine.draft is None else str(engine.draft), "drafter": drafter, "draft_k": engine.draft_k,
        "verify": engine.verify,
    }
