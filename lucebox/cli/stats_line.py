"""A request's figures on one line: `lucebox generate --stats` and the chat's line after each answer."""

from __future__ import annotations


def stats_line(stats: dict, finish_reason: str | None, llm, full: bool = True) -> str:
    """Tokens, speeds, prefix reuse, acceptance when drafting; with `full`, context and KV memory too."""
    prefilled = stats["prompt_tokens"] - stats["cached_prompt_tokens"]
    parts = [f"{stats['generated_tokens']} tokens ({finish_reason})",
             f"decode {stats['decode_tokens_per_s']:.1f} tok/s",
             f"prefill {stats['prefill_tokens_per_s']:.1f} tok/s",
             f"prefilled {prefilled}, reused {stats['cached_prompt_tokens']}"]
    if llm.proposer is not None:
        widths = " ".join(f"{k}:{v}" for k, v in sorted(stats["width_histogram"].items()))
        parts.append(f"acceptance {stats['acceptance_length']:.2f} (widths {widths})")
    if full:
        memory = llm.memory()
        device_kv = memory["ring_caches"] + memory["kv_pool_device"] + memory["kv_chunk_summaries"]
        context = stats["prompt_tokens"] + stats["generated_tokens"]
        parts += [f"context {context}/{llm.max_context}",
                  f"KV device {device_kv / 2**20:.1f} MiB, host {memory['kv_host'] / 2**20:.1f} MiB"]
    return " · ".join(parts)
