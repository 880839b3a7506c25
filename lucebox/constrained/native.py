"""llguidance's compiles, run on one thread of lucebox's own with a 64 MiB stack.

The compile recurses in native code, so how deep it can go depends on the stack of the thread that
calls it: 8 MiB for the main thread and default threads on glibc (the stack `bounds` was measured
with), 2 MiB or 128 KiB on other systems or in other thread pools, where a schema within the bounds
could still overflow it. On this thread the stack is known and 8x the measured one, wherever
lucebox runs. Masks are computed where the engine runs: they walk the parser's state, not the
grammar's (50,000 nested brackets of output, masked on a default thread, measured no deeper).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

STACK_BYTES = 64 * 2**20  # reserved address space; pages are touched only as deep as a compile goes

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_id: int | None = None


def _remember_thread() -> None:
    global _thread_id
    _thread_id = threading.get_ident()


def on_compile_stack(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the compile thread (its value, or its exception)."""
    global _executor
    if threading.get_ident() == _thread_id:  # already there (a compile that compiles)
        return fn(*args, **kwargs)
    with _lock:
        if _executor is None:
            executor = ThreadPoolExecutor(1, thread_name_prefix="lucebox-grammar", initializer=_remember_thread)
            previous = threading.stack_size(STACK_BYTES)
            try:
                future = executor.submit(fn, *args, **kwargs)  # starts its one thread now, with that stack
            finally:
                threading.stack_size(previous)
            _executor = executor
            return future.result()
    return _executor.submit(fn, *args, **kwargs).result()
