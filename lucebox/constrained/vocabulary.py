"""The model's vocabulary as llguidance reads it (an `LLTokenizer`): built once per tokenizer and
model, since it indexes every token's bytes. tokenizer.json goes to llguidance as it is (it reads
the byte-level and Llama-style decoders, and tokenizes with the same rules); a sentencepiece model
as its pieces' bytes (`Tokenizer.token_bytes`) and its own tokenization of continued text. A
tokenizer.json whose decoder llguidance does not read (a bare Metaspace one) is a TokenizerError."""

from __future__ import annotations

import weakref

from lucebox.constrained.spec import llguidance
from lucebox.errors import TokenizerError

# tokenizer -> {(vocab_size, eos ids): LLTokenizer}; goes with the tokenizer
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _SentencePieceVocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer: token bytes, special ids, and
    tokenization of text that continues other text (no BOS, no leading space)."""

    def __init__(self, tokenizer, eos: tuple[int, ...]):
        self.tokens, special = tokenizer.token_bytes()
        self.special_token_ids = sorted(special)
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self._encode = tokenizer.encode_continuation

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance then hands it str
        return self._encode(text)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """The `LLTokenizer` for `tokenizer` over the model's `vocab_size` logits (ids past the
    tokenizer's are never allowed), ending on any of `eos_ids`."""
    if tokenizer is None:
        raise TokenizerError("constrained output needs the model's tokenizer (each token's text), and this "
                             "checkpoint has no tokenizer files; add tokenizer.json or tokenizer.model")
    if not eos_ids:
        raise TokenizerError("constrained output needs an end-of-sequence token to end on, and this model names "
                             "none (eos_token_id in config.json or generation_config.json)")
    built = _BUILT.setdefault(tokenizer, {})
    key = (vocab_size, tuple(eos_ids))
    if key not in built:
        engine = llguidance()
        source = tokenizer.backend_json()
        if source is None:  # sentencepiece: its pieces' bytes, and its own tokenization of text
            source = engine.TokenizerWrapper(_SentencePieceVocabulary(tokenizer, tuple(eos_ids)))
        try:
            built[key] = engine.LLTokenizer(source, n_vocab=vocab_size, eos_token=list(eos_ids))
        except ValueError as e:
            raise TokenizerError(f"constrained output needs llguidance to read this model's tokenizer, and it "
                                 f"cannot: {e}") from None
    return built[key]
