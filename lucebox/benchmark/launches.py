"""Count the device kernels one decode step launches, per part of the model, without a GPU.

Inside a CUDA graph every launch is a node the GPU runs one after another, at ~2 us each on a
consumer card: at Laguna XS.2's 40 layers, launches per layer decide whether a step can approach
its bandwidth roofline. `LaunchCounter` records, while a step body runs, every ATen op that does
device work (views, reshapes and allocations are metadata: excluded) and every Triton launch
(the ATen ops a Triton launch runs itself, e.g. the CPU interpreter's copies, are not counted).
`count_step_launches` runs the graphed step body of an engine eagerly once per decode token and
splits the launches by part: embed, each layer, the head (LM head and greedy choice).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that only describe memory (no kernel runs on a GPU for them).
METADATA_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.as_strided", "aten.t", "aten.transpose", "aten.expand", "aten.slice",
    "aten.select", "aten.split", "aten.split_with_sizes", "aten.unsqueeze", "aten.squeeze", "aten.permute",
    "aten.alias", "aten.detach", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.unbind",
    "aten.lift_fresh", "aten.reshape", "aten._reshape_alias", "aten.narrow", "aten.diagonal", "aten.unflatten",
    "aten.view_as_real", "aten.view_as_complex", "aten.sym_size", "aten.sym_stride", "aten.is_same_size",
    "aten.chunk", "aten.split_with_sizes_copy", "aten.movedim", "aten.flatten", "aten.contiguous_noop",
})


class LaunchCounter(TorchDispatchMode):
    """Every kernel launched while active, in order, as names: "aten.<op>" or "triton.<kernel>"."""

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []
        self._inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not self._inside_triton and name not in METADATA_OPS:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def counting_triton(self):
        """Count Triton launches too (compiled or interpreted kernels), while active."""
        patched = []
        for cls in _triton_launchers():
            original = cls.run

            def run(fn, *args, _original=original, **kwargs):
                self.launches.append("triton." + fn.fn.__name__)
                self._inside_triton += 1
                try:
                    return _original(fn, *args, **kwargs)
                finally:
                    self._inside_triton -= 1

            cls.run = run
            patched.append((cls, original))
        try:
            with self:
                yield self
        finally:
            for cls, original in patched:
                cls.run = original


def _triton_launchers() -> list[type]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: only ATen ops can run
        return []
    return [JITFunction, InterpretedFunction]


def count_step_launches(llm, prompt: list[int], tokens: int = 2) -> dict:
    """Launches of the graphed decode step body at width 1, by part, for the last of `tokens`
    decode steps after prefilling `prompt` (steps are the same launches at every position:
    tests/test_step_graph.py). The engine must have its step runner set to graphed steps run
    eagerly (`StepRunner(decoder, graphs=True, capture=False)`) so the body is what runs."""
    from lucebox.engine.runner import StepGraph
    from lucebox.models.decoder import Decoder

    marks: list[tuple[str, int]] = []
    recorded: list[tuple[list[str], list[tuple[str, int]]]] = []
    counter: LaunchCounter | None = None
    body, run_layer, logits = StepGraph.body, Decoder.run_layer, Decoder.logits

    def mark(part: str) -> None:
        if counter is not None:
            marks.append((part, len(counter.launches)))

    def counted_body(graph):
        nonlocal counter
        counter, marks[:] = LaunchCounter(), [("embed", 0)]
        try:
            with counter.counting_triton():
                out = body(graph)
        finally:
            launches, counter = counter.launches, None
        if graph.inputs.shape[1] == 1:
            recorded.append((launches, list(marks)))
        return out

    def marked_layer(self, i, *args):
        mark(f"layer {i}")
        return run_layer(self, i, *args)

    def marked_logits(self, hidden):
        mark("head")
        return logits(self, hidden)

    StepGraph.body, Decoder.run_layer, Decoder.logits = counted_body, marked_layer, marked_logits
    try:
        llm.generate(prompt, max_tokens=tokens + 1, ignore_eos=True)
    finally:
        StepGraph.body, Decoder.run_layer, Decoder.logits = body, run_layer, logits
    if not recorded:
        raise RuntimeError("no graphed decode step ran: give the engine StepRunner(..., graphs=True, capture=False)")
    launches, marks = recorded[-1]
    ends = [start for _, start in marks[1:]] + [len(launches)]
    return {part: dict(Counter(launches[start:end])) for (part, start), end in zip(marks, ends, strict=True)}
