"""`lucebox train OUT`: tokenizer, corpus, training, held-out measurement and export in one
command. Without --data it trains on the standard library minus `corpus.HELD_OUT` and measures
on the held-out files: the built-in model's recipe.

Everything is written to `OUT.partial` and renamed to OUT when complete (`lucebox.output`): an
existing OUT is refused unless `--overwrite` (start over) or `--resume` (go on from its saved state);
an interrupted run goes on from `OUT.partial` when started again."""

from __future__ import annotations

import json
import lzma
import platform
import time
from pathlib import Path

import sentencepiece
import torch

from lucebox import arguments
from lucebox.errors import InvalidArgumentError
from lucebox.training import corpus, flag_types
from lucebox.training.memory_bound import check_training_fits
from lucebox.training.output_flags import add_output_flags, output_folder
from lucebox.training.target import (
    BUILTIN_CONFIG,
    RANGES,
    VOCAB_SIZES,
    TrainSettings,
    evaluate_bits,
    save_model,
    train,
)
from lucebox.training.tokenizer_training import train_tokenizer


def xz_bits_per_char(texts: list[str], per_file: bool = True) -> float:
    """What `xz -9e` spends per character: a tokenizer-free yardstick. Per file (each compressed on
    its own, as the model reads each file on its own) or on the texts concatenated (xz then also
    reuses one file's text in another, which the model cannot)."""
    def packed(text: str) -> int:
        return len(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))

    chars = sum(len(t) for t in texts)
    return 8 * (sum(map(packed, texts)) if per_file else packed("".join(texts))) / chars


def run(out: Path, data: list[str] | None, eval_data: list[str] | None, settings: TrainSettings,
        vocab_size: int, threads: int | None, progress=None, architecture: dict | None = None) -> dict:
    """Train `architecture` (a Laguna config.json; default `BUILTIN_CONFIG`) into the folder `out`
    (a new one, or one holding an earlier run's `training/state.pt` to go on from); returns the report."""
    check_architecture(architecture or BUILTIN_CONFIG, vocab_size, settings, "the architecture")
    arguments.integer("--threads", threads, 1, flag_types.THREADS_MAX, optional=True)
    if threads:
        torch.set_num_threads(threads)
    work = out / "training"
    work.mkdir(exist_ok=True)
    train_files = corpus.text_files(data) if data else corpus.stdlib_files("train")
    eval_files = corpus.text_files(eval_data) if eval_data else corpus.stdlib_files("held_out")
    train_texts, eval_texts = corpus.read_texts(train_files), corpus.read_texts(eval_files)
    if not (out / "tokenizer.model").is_file():
        train_tokenizer(train_texts, out, vocab_size)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    hf = dict(architecture or BUILTIN_CONFIG, vocab_size=sp.get_piece_size(), bos_token_id=sp.bos_id(),
              eos_token_id=sp.eos_id())
    stream = corpus.token_stream(train_texts, sp.encode, sp.bos_id(), sp.eos_id())
    held_out = [[sp.bos_id(), *sp.encode(t), sp.eos_id()] for t in eval_texts]
    chars = sum(len(t) for t in eval_texts)
    # Between-times figures read the first held-out files (about 40K tokens); the final one reads all.
    quick = 1
    while quick < len(held_out) and sum(len(d) for d in held_out[: quick + 1]) <= 40_000:
        quick += 1

    def evaluate(decoder, final: bool) -> dict:
        docs, n_chars = (held_out, chars) if final else (held_out[:quick], sum(len(t) for t in eval_texts[:quick]))
        bits = evaluate_bits(decoder, docs, settings.length)
        key = "held_out" if final else "held_out_sample"
        return {f"{key}_bits_per_char": round(bits / n_chars, 4),
                f"{key}_perplexity": round(2 ** (bits / sum(len(d) - 1 for d in docs)), 3)}

    started = time.time()
    weights, log = train(hf, stream, evaluate, settings, work / "state.pt", progress)
    save_model(out, hf, weights)
    final = next(r for r in reversed(log) if "held_out_bits_per_char" in r)
    report = {
        "command": "lucebox train", "settings": settings.__dict__, "machine": platform.platform(),
        "cpu_threads": torch.get_num_threads(), "train_files": len(train_texts), "train_tokens": int(len(stream)),
        "held_out_files": [str(f) for f in eval_files], "held_out_chars": chars,
        "held_out_bits_per_char": final["held_out_bits_per_char"],
        "held_out_perplexity": final["held_out_perplexity"],
        "xz_9e_bits_per_char": round(xz_bits_per_char(eval_texts), 4),
        "xz_9e_bits_per_char_concatenated": round(xz_bits_per_char(eval_texts, per_file=False), 4),
        "wall_s_this_run": round(time.time() - started, 1), "log": log,
    }
    (work / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def check_architecture(architecture: dict, vocab_size: int, settings: TrainSettings, source: str) -> None:
    """A LagunaForCausalLM config.json that builds, with `vocab_size` tokens (an upper bound: the
    trained tokenizer may have fewer), `settings.length` positions, and training that fits in host
    memory, all before any work; errors name `source` (the --config file)."""
    from lucebox.errors import ConfigError
    from lucebox.models import build_model_config
    from lucebox.models.hf_config import architecture_name

    arguments.integer("--vocab-size", vocab_size, *VOCAB_SIZES)
    if not isinstance(architecture, dict):
        raise ConfigError(f"{source}: config.json must hold a JSON object")
    if architecture_name(architecture) != "LagunaForCausalLM":
        raise InvalidArgumentError(f"{source}: lucebox train builds LagunaForCausalLM models")
    hf = {**architecture, "vocab_size": vocab_size}
    cfg = build_model_config(hf)
    if settings.length > cfg.max_position_embeddings:
        raise InvalidArgumentError(f"--length {settings.length} is longer than the {cfg.max_position_embeddings} "
                                   f"positions of {source} (max_position_embeddings)")
    check_training_fits(hf, settings.batch, settings.length, source, BUILTIN_CONFIG)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small Laguna-architecture model from scratch (the built-in recipe)")
    p.add_argument("out", help="new model folder to write (an interrupted run goes on when started again)")
    add_output_flags(p, "OUT's training/state.pt")
    p.add_argument("--data", nargs="+", default=None,
                   help="training files or folders of .py files (default: the Python standard library "
                        "minus the held-out modules)")
    p.add_argument("--eval-data", nargs="+", default=None,
                   help="held-out files or folders (default: the held-out standard library modules)")
    defaults = TrainSettings()
    for name, what in (("steps", "optimizer steps"), ("batch", "sequences per step"), ("length", "tokens per sequence"),
                       ("seed", "random seed"), ("eval_every", "steps between held-out evaluations")):
        p.add_argument("--" + name.replace("_", "-"), type=flag_types.integer(*RANGES[name]),
                       default=getattr(defaults, name), help=what)
    p.add_argument("--lr", type=flag_types.learning_rate, default=defaults.lr,
                   help="peak learning rate, in (0, 1] (AdamW, warm-up then cosine)")
    p.add_argument("--vocab-size", type=flag_types.integer(*VOCAB_SIZES), default=4096,
                   help="tokens of the BPE vocabulary trained on the corpus")
    p.add_argument("--threads", type=flag_types.threads, default=None, help="CPU threads for torch (default: torch's)")
    p.add_argument("--config", default=None,
                   help="a LagunaForCausalLM config.json to train instead of the built-in model's (its vocab_size, "
                        "bos and eos ids are set from the trained tokenizer)")


def command(args) -> int:
    from lucebox.training.progress import training_progress

    settings = TrainSettings(steps=args.steps, batch=args.batch, length=args.length, lr=args.lr, seed=args.seed,
                             eval_every=args.eval_every, save_every=args.eval_every)
    architecture = None
    if args.config:
        from lucebox.checkpoints.hf_folder import read_json

        architecture = read_json(Path(args.config))
    # a bad config, or one too big to train here, fails before the output folder is made
    check_architecture(architecture or BUILTIN_CONFIG, args.vocab_size, settings, args.config or "the built-in model")
    default_corpus = [] if args.data and args.eval_data else [corpus.stdlib_root()]
    reads = (*(args.data or ()), *(args.eval_data or ()), *([args.config] if args.config else []), *default_corpus)
    with output_folder(args, "lucebox train", reads=reads) as out, \
            training_progress("training", args.steps) as progress:
        report = run(out, args.data, args.eval_data, settings, args.vocab_size, args.threads, progress,
                     architecture)
    print(f"held-out: {report['held_out_bits_per_char']:.4f} bits/char (xz -9e: {report['xz_9e_bits_per_char']:.4f}), "
          f"perplexity {report['held_out_perplexity']:.2f}; log: {Path(args.out) / 'training' / 'train_log.json'}")
    return 0
