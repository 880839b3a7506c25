"""Triton's CPU interpreter patches its language once per launch (`kernels/interpreter.py`): a
kernel calling device functions (ours and the language's own) computes what it computed, the
language is itself again after the launch, and the walk over the language runs once a launch,
not once a call."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from lucebox.kernels.interpreter import patch_once_per_launch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@triton.jit
def _scaled(x, scale):
    return x * scale + tl.zeros(x.shape, x.dtype)  # tl.zeros: the language's own device function


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    for _ in range(3):
        x = _scaled(x, 2.0)
    tl.store(out_ptr + offsets, x + tl.cdiv(n, BLOCK), mask=mask)


def test_device_functions_compute_the_same_and_the_language_is_restored(monkeypatch):
    assert getattr(interpreter, "lucebox_patched_once_per_launch", False)  # importing the kernels package applied it
    assert patch_once_per_launch()  # and applying it again changes nothing
    zeros_before = tl.zeros
    walks = []
    walk = interpreter.inspect.getmembers
    monkeypatch.setattr(interpreter.inspect, "getmembers", lambda *a: walks.append(a) or walk(*a))
    x = torch.arange(10, dtype=torch.float32)
    out = torch.empty_like(x)
    _kernel[(3,)](x, out, 10, BLOCK=4)
    assert torch.equal(out, x * 8 + 3)
    assert tl.zeros is zeros_before  # restored: outside a kernel the language is Triton's own
    # one walk of each patched module a launch (tl, its tensor and math, tl.core and its tensor and
    # the descriptor base), however many device functions the three programs called
    assert 0 < len(walks) <= 8, len(walks)


def test_launches_from_threads_at_once_share_the_patch_and_the_last_restores_it():
    import threading

    zeros_before = tl.zeros
    x = torch.arange(10, dtype=torch.float32)
    wrong = []

    def launch_many():
        for _ in range(10):
            out = torch.empty_like(x)
            _kernel[(3,)](x, out, 10, BLOCK=4)
            if not torch.equal(out, x * 8 + 3):
                wrong.append(out)

    threads = [threading.Thread(target=launch_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong and tl.zeros is zeros_before
