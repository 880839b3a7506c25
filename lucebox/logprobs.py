"""Log-probabilities of generated tokens (`LLM.stream(logprobs=k)`).

They are the model's raw next-token distribution: log_softmax of the target's logits at the row
that chose each token, before any penalty, temperature, truncation or grammar mask (what OpenAI's
API and vLLM report). So they equal log_softmax(LLM.logits(prompt + generated)) at the same
positions, with speculation or without: a verify row's logits are the target's own. Computed on
the device from the logits a step already has, and read with one copy per round, only for a
request that asks (the default round does no work for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log of the token's probability under the raw logits
    top: list[tuple[int, float]]  # the likeliest tokens (id, logprob), likeliest first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob and the `top` likeliest at its row, for logits (T, V) whose row i chose
    tokens[i] (rows past the last token are not read)."""
    n = len(tokens)
    logp = torch.log_softmax(logits[:n].float(), dim=-1)  # (n, V)
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.long, device=logp.device)[:, None])  # (n, 1)
    values, ids = logp.topk(top, dim=-1)  # (n, top) each; top = 0 gives (n, 0)
    # one read for the round: ids below 2^53 and float32 values are exact in float64
    rows = torch.cat([chosen.double(), values.double(), ids.double()], dim=1).tolist()
    return [TokenLogprob(token, row[0], [(int(i), v) for v, i in zip(row[1:1 + top], row[1 + top:], strict=True)])
            for token, row in zip(tokens, rows, strict=True)]
