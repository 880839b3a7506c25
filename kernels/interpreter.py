"""Triton's CPU interpreter (TRITON_INTERPRET=1: the tests, the dry runs of the GPU benchmarks),
made to patch its language once per kernel launch instead of once per device-function call.

Why: the interpreter runs a kernel with `triton.language`'s builtins swapped for numpy versions
(`_patch_lang`, which walks every member of `tl`, `tl.core`, `tl.tensor` and `tl.math` with
`inspect.getmembers`). It does that at each launch, and again at every call of a `@triton.jit`
function from inside a kernel (our tile helpers, and the language's own `tl.zeros`, `tl.cdiv`...),
where the launch's patch is already in place. That second walk was a fifth of the interpreted
test suite's time.

How, keeping Triton's own code: a launch (`GridExecutor.__call__`, wrapped) patches both modules
a device function can see the language through (`tl` and `tl.core`: what `_patch_lang` looks for
in a function's globals) before it runs, and restores them when it ends; while a launch runs,
`_patch_lang` does nothing. Launches running at once (request threads on the interpreter) share
one patch, restored when the last ends: Triton's per-launch patch could be restored by one launch
under another still running. A jit function called from host code, outside any launch, is patched
as Triton patches it.

Applied only where the interpreter has the parts this was written against (Triton 3.x); elsewhere
it is left as it is (slower, equally right).
"""

from __future__ import annotations

import threading


def patch_once_per_launch() -> bool:
    """Apply the change (once per process, marked on Triton's module: this one may be imported
    twice, as `kernels` from a checkout and as `lucebox.kernels`); whether it is in place."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "lucebox_patched_once_per_launch", False):
        return True
    launcher = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)  # private: hence the checks
    if launcher is None or patch_lang is None or not hasattr(interpreter, "InterpretedFunction"):
        return False

    class EveryLanguageModule:  # what `_patch_lang` reads of a function: the modules in its globals
        __globals__ = {"tl": tl, "core": tl.core}

    class NothingToRestore:
        def restore(self) -> None:
            pass

    lock = threading.Lock()
    launches = {"running": 0, "scope": None}
    launch = launcher.__call__

    def launch_patched_once(self, *args, **kwargs):
        with lock:
            if launches["running"] == 0:
                launches["scope"] = patch_lang(EveryLanguageModule)
            launches["running"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            with lock:
                launches["running"] -= 1
                if launches["running"] == 0:
                    launches["scope"].restore()
                    launches["scope"] = None

    def patch_outside_launches(fn):
        return NothingToRestore() if launches["running"] else patch_lang(fn)

    launcher.__call__ = launch_patched_once
    interpreter._patch_lang = patch_outside_launches  # noqa: SLF001 - read by each launch and device call
    interpreter.lucebox_patched_once_per_launch = True
    return True
