"""A sentencepiece BPE tokenizer for code, trained on the corpus it will read, written as the
`tokenizer.model` + `tokenizer_config.json` pair that the normal tokenizer path loads."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import sentencepiece

from lucebox.errors import InvalidArgumentError

MASK_TOKEN = "<mask>"  # a control symbol: never produced from text; DFlash drafters fill blocks with it


def train_tokenizer(texts: Sequence[str], out: Path, vocab_size: int, seed_sentences: int = 2_000_000) -> None:
    """Byte-fallback BPE over the texts' lines, with text kept verbatim: no normalization, no
    collapsing of the spaces that indent code, no dummy prefix. ids: 0 <unk>, 1 <s>, 2 </s>, 3 <mask>."""
    lines = [line for t in texts for line in t.split("\n") if line.strip()]
    model = io.BytesIO()
    try:
        _train(lines, model, vocab_size, seed_sentences)
    except RuntimeError as e:  # sentencepiece's own checks, e.g. a vocabulary smaller than the alphabet
        raise InvalidArgumentError(f"cannot train a {vocab_size}-token tokenizer on this text: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False, "legacy": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _train(lines: list[str], model: io.BytesIO, vocab_size: int, seed_sentences: int) -> None:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, split_by_whitespace=False,
        allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=8192,
        input_sentence_size=seed_sentences, shuffle_input_sentence=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, control_symbols=[MASK_TOKEN], num_threads=2, minloglevel=2, hard_vocab_limit=False,
    )
