"""`lucebox distill TARGET --out DIR`: data, generation of the target's continuations, drafter
training, export and a held-out acceptance measurement in one command. The drafter is written to
`OUT.partial` and renamed to OUT when complete (`lucebox.output`); an interrupted run goes on when
started again, `--resume` goes on from a finished OUT, `--overwrite` starts over."""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

from lucebox import arguments
from lucebox.builtin import model_path
from lucebox.errors import InvalidArgumentError
from lucebox.models.dflash import build_config
from lucebox.speculative.learned import CALIBRATION_FILE, calibration_record
from lucebox.training import corpus, flag_types
from lucebox.training.distill import (
    RANGES,
    DistillSettings,
    drafter_config,
    flag_name,
    generate_sequences,
    save_drafter,
    train_drafter,
)
from lucebox.training.drafter_start import HEADS, distill_layout
from lucebox.training.memory_bound import check_distill_fits
from lucebox.training.mtp_head import save_head, train_head
from lucebox.training.output_flags import add_output_flags, output_folder
from lucebox.training.tokenizer_training import MASK_TOKEN

EVAL_PROMPTS = (0, 4096)  # 0: the drafter is written without the acceptance measurement
EVAL_TOKENS = (1, 2**16)


def mask_token_id(tokenizer, given: int | None, vocab_size: int) -> int:
    """The id that fills a draft block: given, or the tokenizer's own mask token."""
    if given is None and tokenizer is not None:
        for name in (MASK_TOKEN, "<|mask|>", "<|MASK|>", "[MASK]"):
            if tokenizer.token_to_id(name) is not None:
                given = tokenizer.token_to_id(name)
                break
    if given is None:
        raise InvalidArgumentError("the target's tokenizer has no mask token (<mask>, <|mask|>, [MASK]); pass "
                                   "--mask-token-id with an id the model never produces, e.g. a reserved token")
    if not 0 <= given < vocab_size:
        raise InvalidArgumentError(f"--mask-token-id {given} is outside the target's vocabulary (0..{vocab_size - 1})")
    return given


def held_out_prompts(tokenizer, texts: list[str], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, one from each of the first texts long enough (BOS first)."""
    prompts = []
    for t in texts:
        if len(prompts) == count:  # checked first: a count of 0 reads no text
            break
        ids = tokenizer.encode(t)
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts


def measure_acceptance(target_path: str, drafter: Path, prompts: list[list[int]], max_tokens: int,
                       temperature: float = 0.0) -> dict:
    """Speculative decoding of every prompt with the drafter at a fixed width (every position
    drafted every round): acceptance overall, by position, and the drafter's confidence by position."""
    from lucebox import LLM

    llm = LLM(target_path, draft=str(drafter), device="cpu", dtype="float32", adaptive=False)
    committed = rounds = 0
    drafted: list[list[float]] = []
    confident: list[list[float]] = []
    for seed, p in enumerate(prompts):
        stats = llm.generate(p, max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True).stats
        committed += stats["acceptance_length"] * stats["rounds"]
        rounds += stats["rounds"]
        drafted.append(stats["acceptance_by_position"])
        confident.append(stats["confidence_by_position"])
    return {"acceptance_length": round(committed / rounds, 3),
            "acceptance_by_position": [round(a, 3) for a in mean_by_position(drafted)],
            "confidence_by_position": [round(c, 3) for c in mean_by_position(confident)],
            "prompts": len(prompts), "max_tokens": max_tokens, "temperature": temperature}


def mean_by_position(lists: list[list[float]]) -> list[float]:
    """Per position, the mean over the lists long enough to have it (figures of several prompts)."""
    longest = max(map(len, lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) / sum(1 for x in lists if i < len(x)) for i in range(longest)]


def measure_calibration(target_path: str, drafter: Path, prompts: list[list[int]], max_tokens: int
                        ) -> tuple[dict, dict]:
    """Greedy and sampled (T=0.8) acceptance of the drafter, and the calibration file's content
    (`lucebox.speculative.learned`) the adaptive width starts from."""
    greedy = measure_acceptance(target_path, drafter, prompts, max_tokens)
    sampled = measure_acceptance(target_path, drafter, prompts, max_tokens, temperature=0.8)
    record = {**calibration_record(greedy, sampled), "measured_on": {"prompts": len(prompts), "tokens": max_tokens}}
    return {"greedy": greedy, "sampled": sampled}, record


def run(target_path: str, out: Path, data: list[str] | None, eval_data: list[str] | None, s: DistillSettings,
        threads: int | None, progress_factory, eval_prompts: int = 8, eval_tokens: int = 128) -> dict:
    from lucebox.checkpoints.loading import describe_model, load_model

    check_run_flags(threads, eval_prompts, eval_tokens)
    if threads:
        torch.set_num_threads(threads)
    desc = describe_model(target_path)
    loaded = load_model(desc, torch.float32, torch.device("cpu"))
    target, tokenizer = loaded.decoder, loaded.tokenizer
    if tokenizer is None:
        raise InvalidArgumentError(f"{target_path} has no tokenizer files; distill reads text through the "
                                   "target's own tokenizer")
    hf, s = (None, s) if s.heads == "mtp" else _drafter_layout(s, target_path, desc.hf_config, target, tokenizer)
    if hf is None:
        check_distill_fits(target.cfg, None, s)
    work = out / "training"
    work.mkdir(exist_ok=True)
    texts = corpus.read_texts(corpus.text_files(data) if data else corpus.stdlib_files("train"))
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_ids[0]
    stream = torch.from_numpy(corpus.token_stream(
        texts, lambda t: tokenizer.encode(t, add_special_tokens=False), bos, tokenizer.eos_token_ids[0])).long()
    if len(stream) <= s.prompt_tokens:
        raise InvalidArgumentError(f"the training text has {len(stream)} tokens; it needs more than {s.prompt_tokens}")
    started = time.time()
    generated = work / "sequences.pt"
    if generated.is_file():
        sequences = torch.load(generated, weights_only=True)
    else:
        with progress_factory("generating", s.sequences) as on_batch:
            sequences = generate_sequences(target, stream, s, on_batch=lambda n: on_batch(n, {}))
        torch.save(sequences, generated)
    with progress_factory("distilling", s.steps) as on_step:
        if hf is None:  # an MTP head
            weights, log = train_head(target, sequences, s, work / "state.pt", on_step)
            save_head(out, desc.hf_config, target, weights, target_path)
        else:
            weights, log = train_drafter(target, hf, sequences, s, work / "state.pt", on_step)
            save_drafter(out, hf, weights)
    eval_texts = corpus.read_texts(corpus.text_files(eval_data) if eval_data else corpus.stdlib_files("held_out"))
    prompts = held_out_prompts(tokenizer, eval_texts, eval_prompts, 64)
    report = {
        "command": "lucebox distill", "target": str(target_path), "settings": dataclasses.asdict(s),
        "drafter_config": hf, "machine": platform.platform(), "cpu_threads": torch.get_num_threads(),
        "train_tokens": int(len(stream)), "sequences": list(sequences.shape),
        **_held_out(target_path, out, prompts, eval_tokens),
        "wall_s_this_run": round(time.time() - started, 1), "log": log,
    }
    (work / "distill_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _drafter_layout(s: DistillSettings, target_path: str, target_hf: dict, target, tokenizer
                    ) -> tuple[dict, DistillSettings]:
    """The DFlash or DSpark drafter's config.json, checked against the target and the memory, and
    the settings with an --init drafter's block size."""
    hf = distill_layout(s.heads, s.markov_rank, s.init, target_path, target_hf, target.cfg, lambda: drafter_config(
        target_hf, target, s, mask_token_id(tokenizer, s.mask_token_id, target.cfg.vocab_size)))
    s = dataclasses.replace(s, block_size=build_config(hf).block_size)  # --init's block size rules (checked again)
    if not all(0 <= i < len(target.cfg.layers) for i in build_config(hf).target_layer_ids):
        raise InvalidArgumentError(f"--target-layers must be decoder layers 0..{len(target.cfg.layers) - 1}")
    check_distill_fits(target.cfg, build_config(hf), s)
    return hf, s


def check_run_flags(threads: int | None, eval_prompts: int, eval_tokens: int) -> None:
    """`run`'s own arguments, in range before anything is loaded (the CLI's flag types check the same)."""
    arguments.integer("--threads", threads, 1, flag_types.THREADS_MAX, optional=True)
    arguments.integer("--eval-prompts", eval_prompts, *EVAL_PROMPTS)
    arguments.integer("--eval-tokens", eval_tokens, *EVAL_TOKENS)


def _held_out(target_path: str, out: Path, prompts: list[list[int]], tokens: int) -> dict:
    if not prompts:
        return {"held_out_acceptance": None, "held_out_acceptance_sampled": None}
    measured, record = measure_calibration(target_path, out, prompts, tokens)
    (out / CALIBRATION_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return {"held_out_acceptance": measured["greedy"], "held_out_acceptance_sampled": measured["sampled"]}


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a DFlash block drafter for a target model on text files")
    p.add_argument("target", help="target model folder (any supported architecture, with its tokenizer)")
    p.add_argument("--out", required=True, help="new drafter folder to write (an interrupted run goes on when "
                                                "started again)")
    add_output_flags(p, "OUT's training/state.pt and sequences.pt")
    p.add_argument("--data", nargs="+", default=None,
                   help="text files or folders of .py files (default: the Python standard library minus the "
                        "held-out modules)")
    p.add_argument("--eval-data", nargs="+", default=None,
                   help="held-out files for the acceptance measurement (default: the held-out stdlib modules)")
    d = DistillSettings()
    for name, what in (("layers", "drafter layers"), ("block_size", "tokens per drafted block (the first is the "
                       "anchor: block_size - 1 drafts)"), ("attention_heads", "drafter query heads"),
                       ("kv_heads", "drafter KV heads"), ("head_dim", "drafter head size"),
                       ("intermediate_size", "drafter MLP width"), ("steps", "optimizer steps"),
                       ("batch", "sequences per step"), ("anchors", "blocks per sequence per step"),
                       ("prompt_tokens", "text tokens each generated sequence starts from"),
                       ("generated_tokens", "target's greedy tokens after each prompt"), ("seed", "random seed")):
        p.add_argument(flag_name(name), type=flag_types.integer(*RANGES[name]), default=getattr(d, name), help=what)
    p.add_argument("--sequences", type=flag_types.integer(*RANGES["sequences"]), default=None,
                   help="sequences of the target's text generated before training (default: follows --steps and "
                        "--batch, each drawn about 8 times, between 64 and 2048)")
    p.add_argument("--lr", type=flag_types.learning_rate, default=d.lr,
                   help="peak learning rate, in (0, 1] (AdamW, warm-up then cosine)")
    p.add_argument("--mask-token-id", type=flag_types.integer(0, 2**31 - 1), default=None,
                   help="default: the tokenizer's mask token")
    p.add_argument("--target-layers", type=flag_types.layer_list, default=None,
                   help="comma-separated decoder layers whose outputs the drafter reads (default: 3 spread "
                        "over the depth)")
    p.add_argument("--heads", choices=HEADS, default=d.heads,
                   help="dflash: the plain DFlash drafter (z-lab layout); dspark: DFlash plus DSpark's Markov head "
                        "(each draft conditioned on the one before it) and confidence head, in the Speculators "
                        "layout; mtp: an MTP head (one decoder layer that drafts from the target's last hidden "
                        "state), as Qwen3-Next and Qwen3.5 checkpoints ship theirs (mtp.*), in a folder of its own "
                        f"that --draft takes (default: {d.heads})")
    # range-checked by DistillSettings before any work: one error line, exit code 2
    p.add_argument("--markov-rank", type=int, default=d.markov_rank,
                   help="rank of new DSpark Markov heads, with --heads dspark (a DSpark --init drafter keeps its own) "
                        f"(default: {d.markov_rank})")
    p.add_argument("--init", default=None, metavar="DRAFTER_FOLDER",
                   help="start from this DFlash or DSpark drafter (z-lab or Speculators layout): its backbone, and "
                        "with --heads dspark its DSpark heads if it has them; its shape, target layers, block size and "
                        "mask token replace those flags (default: a new random backbone)")
    p.add_argument("--freeze-backbone", action="store_true",
                   help="with --init and --heads dspark, train only the DSpark heads: the backbone is kept as it "
                        "is and runs without backward, so training is fast (default: train everything)")
    p.add_argument("--eval-prompts", type=flag_types.integer(*EVAL_PROMPTS), default=8,
                   help="held-out prompts for the acceptance measurement (0: no measurement)")
    p.add_argument("--eval-tokens", type=flag_types.integer(*EVAL_TOKENS), default=128,
                   help="greedy tokens generated per held-out prompt")
    p.add_argument("--threads", type=flag_types.threads, default=None, help="CPU threads for torch (default: torch's)")


def command(args) -> int:
    from lucebox.training.progress import training_progress

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillSettings) if hasattr(args, f.name)}
    s = DistillSettings(**{**values, "target_layer_ids": args.target_layers, "mask_token_id": args.mask_token_id})
    reads = (model_path(args.target), *([args.init] if args.init else []), *(args.data or [corpus.stdlib_root()]),
             *(args.eval_data or ()))
    with output_folder(args, "lucebox distill", reads=reads) as out:
        report = run(args.target, out, args.data, args.eval_data, s, args.threads, training_progress,
                     args.eval_prompts, args.eval_tokens)
    acc = report["held_out_acceptance"]
    if acc:
        print(f"held-out acceptance length {acc['acceptance_length']:.2f} tokens per round; by position "
              f"{acc['acceptance_by_position']}; log: {Path(args.out) / 'training' / 'distill_log.json'}")
    return 0
