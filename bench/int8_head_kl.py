"""What the int8 LM head (`lm_head="int8"`) costs in quality and saves in bytes, on the built-in model.

Held-out standard-library text (not trained on) goes through the built-in code model twice, with the
float head and with the int8 one (codes with a float16 scale per vocabulary row); everything below
the head is the same, so the difference is the head's alone. Per position: the KL divergence of the
int8 head's next-token distribution from the float head's, whether the greedy token agrees, and the
mean log-likelihood of the text. Bytes: what one step's logits read from each head, for the built-in
model and, from its config alone (examples/laguna-xs2), for Laguna XS.2.

    python bench/int8_head_kl.py                       # bench/results/local/
    python bench/int8_head_kl.py --out bench/results   # replaces the committed result
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import write_result  # noqa: E402


def head_figures(float_logits: torch.Tensor, int8_logits: torch.Tensor, tokens: list[int]) -> dict:
    """KL(float || int8) per position, greedy agreement and the text's mean NLL under each head;
    logits (T, V) for the T positions of `tokens`."""
    log_p, log_q = torch.log_softmax(float_logits.double(), -1), torch.log_softmax(int8_logits.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    following = torch.tensor(tokens[1:])[:, None]
    return {"positions": len(tokens), "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "top1_agreement": (float_logits.argmax(-1) == int8_logits.argmax(-1)).double().mean().item(),
            "nll_per_token_float_head": -log_p[:-1].gather(-1, following).mean().item(),
            "nll_per_token_int8_head": -log_q[:-1].gather(-1, following).mean().item()}


def held_out_tokens(tokenizer, count: int) -> list[int]:
    from lucebox.training.corpus import read_texts, stdlib_files

    return tokenizer.encode("\n".join(read_texts(stdlib_files("held_out")[:20])))[:count]


def bytes_figures(cfg, dtype: torch.dtype) -> dict:
    from lucebox.memory.lm_head import float_head_bytes, int8_head_bytes

    read_float, read_int8 = float_head_bytes(cfg, dtype), int8_head_bytes(cfg)
    return {"dtype": str(dtype).split(".")[-1], "vocab": cfg.vocab_size, "hidden": cfg.hidden_size,
            "head_bytes_read_per_token_float": read_float, "head_bytes_read_per_token_int8": read_int8,
            "bytes_saved_per_token": read_float - read_int8, "tied_embeddings": cfg.tie_word_embeddings}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored (one prefill)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()

    import lucebox

    options = dict(device="cpu", dtype="float32", draft=None, max_context=args.tokens)
    float_head, int8_head = lucebox.LLM(lm_head="float", **options), lucebox.LLM(lm_head="int8", **options)
    tokens = held_out_tokens(float_head.tokenizer, args.tokens)
    figures = head_figures(float_head.logits(tokens), int8_head.logits(tokens), tokens)
    print({k: round(v, 8) for k, v in figures.items()})
    from lucebox.checkpoints.loading import describe_model

    cfg, xs2 = float_head.config, describe_model(Path(__file__).resolve().parents[1] / "examples" / "laguna-xs2").cfg
    payload = {"model": "built-in laguna-code-6m (float32 activations)", "text": "held-out standard-library files",
               "head": "int8 codes, one float16 scale per vocabulary row", "quality": figures,
               "bytes": {"built_in_float32": bytes_figures(cfg, torch.float32),
                         "built_in_bfloat16": bytes_figures(cfg, torch.bfloat16),
                         "laguna_xs2_bfloat16_from_config": bytes_figures(xs2, torch.bfloat16)}}
    print(payload["bytes"])
    print(write_result("int8_head_kl", payload, args.out))


if __name__ == "__main__":
    main()
