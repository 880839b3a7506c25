"""lucebox beside llama.cpp and transformers on the same GGUF files, in one run.

Models, written into a temporary folder this bench creates (and removes):
- `builtin`: the built-in model (Laguna, 6M parameters, SentencePiece vocabulary of 4096);
- `qwen3moe`: a random Qwen3-MoE at K-quant-friendly widths (every matrix 256 inputs wide or a
  multiple), with the built-in model's tokenizer so that llama.cpp has a vocabulary;
each as F32 and Q8_0 (written by gguf-py as llama.cpp's converter would: `tests/gguf_models`)
and as Q4_K_M (made from the F32 file by llama.cpp's own quantizer, so only when llama-cpp-python
is installed: `pip install -e ".[bench]"`, which compiles llama.cpp).

Engines: lucebox (torch reference path, float32 activations); llama.cpp through llama-cpp-python
(skipped when it is not importable); transformers, the model whose weights are exactly what the
F32/Q8_0 file decodes to (it has no twin of llama.cpp's Q4_K_M file). Every engine prefills the
same prompt (token ids of Python source) and decodes greedily on the same number of threads;
runs alternate between engines (engine order rotates each round), and medians are reported with
each engine's speed over lucebox's. KL columns: mean KL(lucebox || engine) of the next-token
distributions over the prompt, in nats; "same tokens": how many decoded tokens match lucebox's.

    /work/venv-llama/bin/python bench/peers.py                      # writes bench/results/local/
    python bench/peers.py --out bench/results --name peers_after    # replaces the committed result
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch  # noqa: E402
from common import write_result  # noqa: E402
from peer_engines import LlamaCpp, Lucebox, Transformers, mean_kl  # noqa: E402

# Then neither this folder (bench/kernels.py) nor the repository root (kernels/) stays on the path:
# either would shadow the pip package `kernels` transformers looks for. tests/ holds the GGUF
# writer the parity tests use.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

QTYPES = ("F32", "Q8_0", "Q4_K_M")


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def tiny_qwen3_moe():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                               max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=2, pad_token_id=None)
    return tf.Qwen3MoeForCausalLM(config).to(torch.float64).eval()


def source_model(which: str):
    """(transformers model in float64, GGUF architecture name)."""
    import transformers

    from lucebox.builtin import builtin_model

    if which == "builtin":
        return transformers.AutoModelForCausalLM.from_pretrained(builtin_model(), dtype=torch.float64), "laguna"
    return tiny_qwen3_moe(), "qwen3moe"


def write_files(which: str, qtypes: list[str], folder: Path) -> dict[str, tuple[Path, object]]:
    """{qtype: (GGUF file, its transformers twin or None)}."""
    import sentencepiece as spm
    from gguf_models import write_gguf
    from test_gguf_builtin import _tokenizer_metadata

    from lucebox.builtin import builtin_model

    sp = spm.SentencePieceProcessor(model_file=str(builtin_model() / "tokenizer.model"))
    files = {}
    for qtype in [q for q in ("F32", "Q8_0") if q in qtypes or (q == "F32" and "Q4_K_M" in qtypes)]:
        model, arch = source_model(which)
        path = folder / f"{which}-{qtype}.gguf"
        twin = write_gguf(model, arch, qtype, path, more_metadata=_tokenizer_metadata(sp))
        files[qtype] = (path, twin)
    if "Q4_K_M" in qtypes and llama_cpp_installed():
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        path = folder / f"{which}-Q4_K_M.gguf"
        if llama_cpp.llama_model_quantize(str(files["F32"][0]).encode(), str(path).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {files['F32'][0]} to Q4_K_M")
        files["Q4_K_M"] = (path, None)
    elif "Q4_K_M" in qtypes:
        print(f"{which} Q4_K_M: skipped (made by llama.cpp's quantizer: pip install -e '.[bench]')", flush=True)
    return {q: files[q] for q in qtypes if q in files}


def prompt_ids(length: int) -> list[int]:
    """BOS and then the built-in tokenizer's ids of Python source (this repository's, stable)."""
    import sentencepiece as spm

    from lucebox.builtin import builtin_model

    sp = spm.SentencePieceProcessor(model_file=str(builtin_model() / "tokenizer.model"))
    import lucebox.kernels.attention as source

    ids = [sp.bos_id()] + sp.encode(inspect.getsource(source))
    return ids[:length]


def compare(path: Path, twin, prompt: list[int], tokens: int, runs: int, threads: int, kl_tokens: int) -> dict:
    engines = [Lucebox(path, threads)]
    if llama_cpp_installed():
        engines.append(LlamaCpp(path, threads))
    if twin is not None:
        engines.append(Transformers(twin, threads))
    for engine in engines:  # warm-up: first-call allocations, lazily dequantized weights
        engine.run(prompt[:16], 4)
    results: dict[str, dict[str, list]] = {e.name: {"prefill": [], "decode": [], "ids": []} for e in engines}
    for r in range(runs):
        for engine in engines[r % len(engines):] + engines[: r % len(engines)]:
            prefill, decode, ids = engine.run(prompt, tokens)
            row = results[engine.name]
            row["prefill"].append(prefill)
            row["decode"].append(decode)
            row["ids"] = ids
    ours = results["lucebox"]
    reference = engines[0].logits(prompt[:kl_tokens])

    def kl(engine) -> float:
        return 0.0 if engine is engines[0] else mean_kl(reference, engine.logits(prompt[:kl_tokens]))

    table = {}
    for engine in engines:
        row = results[engine.name]
        prefill, decode = statistics.median(row["prefill"]), statistics.median(row["decode"])
        same = next((i for i, (a, b) in enumerate(zip(row["ids"], ours["ids"], strict=True)) if a != b), tokens)
        table[engine.name] = {
            "prefill_tokens_per_s": round(prefill, 1), "decode_tokens_per_s": round(decode, 1),
            "prefill_runs": [round(x, 1) for x in row["prefill"]], "decode_runs": [round(x, 1) for x in row["decode"]],
            "prefill_over_lucebox": round(prefill / statistics.median(ours["prefill"]), 3),
            "decode_over_lucebox": round(decode / statistics.median(ours["decode"]), 3),
            "kl_from_lucebox_nats": kl(engine),
            "same_tokens_as_lucebox": same}
    return table


def versions() -> dict:
    import importlib.metadata as md
    import subprocess

    import lucebox

    source = Path(lucebox.__file__).resolve().parent  # PYTHONPATH may point at an older checkout
    head = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    out = {"lucebox_source": str(source), "lucebox_commit": head.stdout.strip() or None, "torch": torch.__version__}
    for name in ("transformers", "llama-cpp-python", "gguf"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="builtin,qwen3moe")
    p.add_argument("--qtypes", default=",".join(QTYPES))
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded after the prompt")
    p.add_argument("--runs", type=int, default=3, help="alternating runs per engine (medians reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kl-tokens", type=int, default=128, help="prompt positions the KL columns average over")
    p.add_argument("--name", default="peers", help="result name (peers_before, peers_after, ...)")
    p.add_argument("--out", default=None, help="directory for the JSON (default bench/results/local)")
    args = p.parse_args()

    prompt = prompt_ids(args.prompt)
    load = [os.getloadavg()[0]]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="lucebox-peers-") as tmp:
        for which in args.models.split(","):
            files = write_files(which, args.qtypes.split(","), Path(tmp))
            for qtype, (path, twin) in files.items():
                rows[f"{which} {qtype}"] = table = compare(path, twin, prompt, args.tokens, args.runs, args.threads,
                                                           min(args.kl_tokens, len(prompt)))
                load.append(os.getloadavg()[0])
                for name, row in table.items():
                    print(f"{which} {qtype} {name}: prefill {row['prefill_tokens_per_s']} tok/s, decode "
                          f"{row['decode_tokens_per_s']} tok/s ({row['decode_over_lucebox']}x lucebox), KL "
                          f"{row['kl_from_lucebox_nats']:.2e}, same tokens {row['same_tokens_as_lucebox']}", flush=True)
    payload = {"setup": {"prompt_tokens": len(prompt), "decode_tokens": args.tokens, "runs": args.runs,
                         "threads": args.threads, "greedy": True, "dtype": "float32 activations",
                         "llama_cpp": llama_cpp_installed(),
                         "load_average_1min": [round(x, 2) for x in load]},
               "versions": versions(), "results": rows}
    if not llama_cpp_installed():
        payload["llama_cpp_column"] = ("llama-cpp-python is not installed here; fill the column with: pip install "
                                       "-e '.[test,bench]' && python bench/peers.py --out bench/results")
    print(f"wrote {write_result(args.name, payload, args.out)}")


if __name__ == "__main__":
    main()
