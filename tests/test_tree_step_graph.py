"""The graphed tree-verify step is position- and shape-independent: trees of one width but
different shapes, at successive positions (ring wraps, pool chunk boundaries), record the same
ops with the same arguments (`tests/test_step_graph.py`'s recorder), so one CUDA graph per width
serves every tree: the tree's depths and ancestor bits are static inputs, never host reads."""

import torch
from test_step_graph import OpRecorder, on_gpu_paths
from test_tree_attention import small_tree
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.engine.runner import StepGraph, StepRunner


def test_tree_steps_record_the_same_ops_whatever_the_tree_and_position(reference_models, monkeypatch):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=512, kv_pool_tokens=512,
                      kv_policy="select", prefill_chunk=64, draft=None)
    llm.engine.runner = runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    recordings = []
    body = StepGraph.body

    def recorded_body(graph):
        recorder = OpRecorder()
        with recorder:
            out = body(graph)
        recordings.append(recorder.ops)
        return out

    monkeypatch.setattr(StepGraph, "body", recorded_body)
    on_gpu_paths(monkeypatch)  # as in a graph
    cache = llm.engine.new_cache()
    for _ in llm.engine.prefill(torch.randint(0, VOCAB, (58,), generator=torch.Generator().manual_seed(1)).tolist(),
                                cache):
        pass
    shapes = set()
    for seed in range(8):  # crosses the chunk boundary at 64 and wraps the window-8 rings
        tree = small_tree(budget=5, seed=seed)
        shapes.add(tuple(tree.parents))
        position = cache.length
        runner.step(tree.tokens, Step.span(position, len(tree), llm.device), cache, (), tree)
        path = tree.path(len(tree) - 1)
        cache.accept_path(position, path)
        cache.commit(position + 1 + len(path))
        cache.rollback(position + 1 + len(path))
    assert len(shapes) > 1 and len(runner.widths) == 1  # different trees, one graph
    first = recordings[0]
    assert not any("_local_scalar_dense" in op for op, _ in first)  # no host read inside the step
    for ops in recordings[1:]:
        assert ops == first
