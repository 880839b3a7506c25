"""On the CPU the torch reference dequantizes each quantized weight once and keeps it
(`kernels.quant.kept_dense`) instead of at every step: the same values, so the same logits and
tokens, bit for bit, as the per-step path (what it does when the host has no memory to spare); the
memory plan counts the copies' bytes before loading, as `LLM.memory()` then finds them."""

from __future__ import annotations

import torch
from gguf_models import write_tiny_gguf
from lucebox.kernels import quant

import lucebox
from lucebox.memory.plan import dense_copy_bytes


def test_kept_dequantized_weights_give_the_per_step_path_s_logits_and_tokens(tmp_path, monkeypatch):
    write_tiny_gguf("qwen3moe", "Q4_K", tmp_path / "model.gguf")
    prefill, decode = list(range(3, 40)), [5]  # 37 rows: the expert loop; 1 row: a decode step

    def run() -> tuple[lucebox.LLM, list[torch.Tensor], list[int]]:
        llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32", draft=None)
        logits = [llm.logits(prefill), llm.logits(decode)]
        return llm, logits, llm.generate(prefill, max_tokens=12, ignore_eos=True, temperature=0.0).token_ids

    kept, kept_logits, kept_tokens = run()
    experts = kept.engine.decoder.w["layers.1.experts_gate_up"]
    assert isinstance(experts, quant.QuantizedTensor) and experts.dense is not None  # the codes stay too
    monkeypatch.setattr(quant, "_free_host_bytes", lambda: 0)  # no room: every step dequantizes again
    per_step, per_step_logits, per_step_tokens = run()
    assert per_step.engine.decoder.w["layers.1.experts_gate_up"].dense is None
    for got, want in zip(kept_logits, per_step_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert kept_tokens == per_step_tokens
    # The plan, read from the file's index before loading, counts every copy kept (none kept: 0 held).
    held = kept.memory()
    assert held["dense_copies_cpu"] == held["dense_copies_cpu_max"] > 0
    assert per_step.memory()["dense_copies_cpu"] == 0
    # lucebox's own quantization counts the same weights (every linear of this file is quantized).
    assert dense_copy_bytes(kept.config, torch.float32, "int4") == held["dense_copies_cpu_max"]
    assert dense_copy_bytes(kept.config, torch.float32, None) == 0
