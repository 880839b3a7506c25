"""The GPU check's step section (`bench/gpu_check.py`): what one decode step costs on the device.

- kernels per step: the graphed step body of Laguna XS.2 cut to its first five layers (int4, every
  layer kind) run once under torch.profiler, every device kernel counted (vendor GEMMs' own
  kernels included), beside the launches `lucebox.benchmark.launches` counts for the same body;
- verify-8 over decode-1: both widths replayed as the engine's own graphs on its bound cache;
- per-kernel bandwidth as a fraction of the device's copy peak: the quantized GEMV and the MoE
  expert kernels at Laguna XS.2's widths (`bench/kernels.py`'s sections, decode rows).
On the CPU (the dry run) the same code runs eagerly at tiny widths, without the profiler.
"""

from __future__ import annotations

import time


def step_seconds(llm, cache, width: int, position: int, reps: int, clock=time.perf_counter) -> float:
    """Median seconds of `width`-row steps at `position` through the engine's runner (a graph
    replay on CUDA after the first, which captures), each rolled back after; `clock` times them."""
    import torch

    from lucebox.caches import Step

    device, vocab = llm.device, llm.config.vocab_size
    rows = [(position * 31 + i * 7) % vocab for i in range(width)]
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        llm.engine.runner.step(rows, Step.span(position, width, device), cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(clock() - start)
        cache.rollback(position)
    return sorted(times[1:])[reps // 2]


def _device_kernels(llm, cache, position: int) -> int | None:
    """Device kernels of one eager run of the width-1 step body, from the profiler (CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lucebox.caches import Step

    if llm.device.type != "cuda":
        return None
    for layer in cache.layers:  # the host's half of the step, as `StepRunner.step` does it
        layer.reserve(Step.span(position, 1, llm.device))
    graph = llm.engine.runner._graph(1, (), cache, False)
    graph.inputs[0].fill_(1)
    graph.inputs[1].fill_(position)
    torch.cuda.synchronize(llm.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.body()
        torch.cuda.synchronize(llm.device)
    cache.rollback(position)
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def step_profile(check) -> dict:
    import torch

    import lucebox
    from bench.kernel_count import TINY, XS2_WIDTHS, count, parse_args, pattern_model
    from bench.kernels import TINY as TINY_SHAPES
    from bench.kernels import XS2 as XS2_SHAPES
    from bench.kernels import Timer, bench_linear, bench_moe, peak_bandwidth

    cuda = check.cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    counted = count(parse_args(["--widths", "xs2", "--device", "cuda"] if cuda else ["--widths", "tiny"]))
    kept = ("launches_per_layer", "xs2_layers_per_kind", "most_per_layer", "launches_per_token_xs2", "head",
            "ops_per_kind")
    check.record("step_profile", **{key: counted[key] for key in kept})
    folder = pattern_model(XS2_WIDTHS if cuda else TINY)
    llm = lucebox.LLM(str(folder), load_format="dummy", device=device.type, dtype=str(dtype).split(".")[-1],
                      quantization="int4", max_context=4096)
    cache = llm.engine.new_cache()
    llm.engine.runner.bind(cache)
    prompt = [(i * 7919) % llm.config.vocab_size for i in range(512 if cuda else 16)]
    for _ in llm.engine.prefill(prompt, cache):
        pass
    cache.commit(len(prompt))
    reps = 20 if cuda else 2
    decode = step_seconds(llm, cache, 1, len(prompt), reps)
    verify = step_seconds(llm, cache, 8, len(prompt), reps)
    check.record("step_profile", device_kernels_per_step_5_layers=_device_kernels(llm, cache, len(prompt)),
                 decode1_ms=decode * 1e3, verify8_ms=verify * 1e3, verify8_over_decode1=verify / decode,
                 graphed=llm.engine.runner.capture)
    shapes = XS2_SHAPES if cuda else TINY_SHAPES
    timer = Timer(device, 20 if cuda else 1)
    peak = peak_bandwidth(device, shapes["copy_bytes"], timer)
    kernels = [row for row in bench_linear(shapes, dtype, device, timer, peak) + bench_moe(
        shapes, dtype, "int4", device, timer, peak) if row["M"] in (1, 8)]
    return {"status": "ok", "peak_gb_per_s": peak / 1e9, "kernel_bandwidth": kernels,
            **({} if cuda else {"note": "no CUDA: eager steps, no profiler, CPU bandwidth"})}
