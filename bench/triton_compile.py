"""Record the Triton kernel launches some Python code makes and compile each distinct one for a real
GPU with Triton's own compiler, without a GPU.

`tests/kernel_compile.py` (does every kernel compile for sm_86 and sm_90?) and `bench/kernel_specs.py`
(registers, spills and hot-loop SASS of each decode kernel) share this. Importing it turns Triton's
interpreter off for this process, so import it before any kernel module, and never from a test
process that runs kernels through the interpreter (run a script in a subprocess instead).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

# Shared memory one block may use: RTX 3090 (sm_86) and Hopper (sm_90).
SHARED_MEMORY = {86: 101376, 90: 232448}


@dataclass(frozen=True)
class Launch:
    """One distinct specialization of a kernel, as Triton's launcher would build it on a GPU."""

    module: str
    kernel: str
    signature: dict  # argument name -> Triton type ("*bf16", "i32", "constexpr"...)
    constexprs: dict  # (argument index,) or name -> value
    attrs: dict  # divisibility / equal-to-1 attributes of the arguments
    options: dict  # launch options as given (num_warps, num_stages...): each target completes the rest

    def named_constexprs(self) -> dict:
        """Constexpr values by argument name (BLOCK_N, BITS...)."""
        names = list(self.signature)
        return {names[k[0]] if isinstance(k, tuple) and len(k) == 1 else str(k): v
                for k, v in self.constexprs.items()}


def record_launches(exercise: Callable[[], None]) -> list[Launch]:
    """Every distinct launch `exercise()` makes, specialized as Triton's launcher would on a GPU
    (integers equal to 1 and 16-byte alignment or divisibility by 16 of pointers and integers).
    Kernels are recorded, not run: `exercise` may pass CPU tensors."""
    launches = {}
    backend = make_backend(GPUTarget("cuda", 90, 32))
    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        given = {k: v for k, v in kwargs.items() if k in options.__dict__}
        key = repr((self.fn.__module__, self.fn.__name__, specialization, sorted(given.items())))
        launches[key] = Launch(self.fn.__module__, self.fn.__name__, signature, constexprs, attrs, given)

    JITFunction.run = run
    try:
        exercise()
    finally:
        JITFunction.run = original_run
    return list(launches.values())


def compile_launch(launch: Launch, capability: int):
    """Triton's CompiledKernel of `launch` for sm_`capability` (its `asm["cubin"]`, `metadata`)."""
    module = sys.modules.get(launch.module) or __import__(launch.module, fromlist=[launch.kernel])
    source = ASTSource(fn=getattr(module, launch.kernel), signature=launch.signature, constexprs=launch.constexprs,
                       attrs=launch.attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch.options)


def compile_all(jobs: list, worker: Callable[[object], dict], crashed: Callable[[object], dict]) -> list[dict]:
    """worker(job) for every job, in parallel processes on every core, in the jobs' order;
    crashed(job) stands in for a job whose process the compiler aborted (an LLVM error)."""
    results = []
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = [(job, pool.submit(worker, job)) for job in jobs]
        for job, future in futures:
            try:
                results.append(future.result())
            except BrokenProcessPool:
                results.append(crashed(job))
    return results
