"""Triton's CPU interpreter (TRITON_INTERPRET=1: the tests, the dry runs of the GPU benchmarks),
made to patch its language once per kernel launch instead of once per device-function call.

Why: the interpreter runs a kernel with `triton.language`'s builtins swapped for numpy versions
(`_patch_lang`, which walks every member of `tl`, `tl.core`, `tl.tensor` and `tl.math` with
`inspect.getmembers`). It does that at each launch, and again at every call of a `@triton.jit`
function from inside a kernel (our tile helpers, and the language's own `tl.zeros`, `tl.cdiv`...),
where it is redundant: a launch's patch is still in place. That second walk was a fifth of the
interpreted test suite's time. Here a launch patches both modules a device function can see the
language through (`tl` and `tl.core`: what `_patch_lang` looks for in a function's globals), and a
device-function call patches nothing. Each launch still restores the language when it ends.

Applied only where the interpreter has the shape this was written against (Triton 3.x); elsewhere
the interpreter is left as it is (slower, equally right).
"""

from __future__ import annotations


def patch_once_per_launch() -> bool:
    """Apply the change (once per process, marked on Triton's module: this one may be imported
    twice, as `kernels` from a checkout and as `lucebox.kernels`); whether it is in place."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "lucebox_patched_once_per_launch", False):
        return True

    function = getattr(interpreter, "InterpretedFunction", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)  # private: hence the shape checks here
    if function is None or patch_lang is None or not hasattr(function, "rewrite"):
        return False

    class EveryLanguageModule:  # what `_patch_lang` reads of a function: the modules in its globals
        __globals__ = {"tl": tl, "core": tl.core}

    def patch_for_the_launch(fn):
        return patch_lang(EveryLanguageModule)

    def call_in_the_launch(self, *args, **kwargs):  # `InterpretedFunction.__call__`, its patch left out
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter._patch_lang = patch_for_the_launch  # noqa: SLF001 - read by `GridExecutor` at each launch
    function.__call__ = call_in_the_launch
    interpreter.lucebox_patched_once_per_launch = True
    return True
