"""The model's vocabulary as llguidance reads it (an `LLTokenizer`): built once per tokenizer and
model, since it indexes every token's bytes. Each token's bytes come from tokenizer.json read by
llguidance (it reads the byte-level and Llama-style decoders), or from a sentencepiece model's pieces
(`Tokenizer.token_bytes`). Text reaches llguidance's tokenization as text: a special token's name
in a grammar's literal ("</s>", "[TOOL_CALLS]") is spelled with ordinary tokens, since the engine
lets no special token write text (a special one there made the mask, the forced tokens and the
commits disagree). A tokenizer.json whose decoder llguidance does not read (a bare Metaspace one)
is a TokenizerError."""

from __future__ import annotations

import weakref

from lucebox.constrained.spec import llguidance
from lucebox.errors import TokenizerError

# tokenizer -> {(vocab_size, eos ids): LLTokenizer}; goes with the tokenizer
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PlainTextVocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer: token bytes, special ids, and
    tokenization of text that continues other text (no BOS, no leading space, no special token)."""

    def __init__(self, tokenizer, tokens: list[bytes], special: set[int], vocab_size: int, eos: tuple[int, ...]):
        # ids past the tokenizer's (the model's logits may be more): special, so never allowed
        padding = range(len(tokens), vocab_size)
        self.tokens, self.special_token_ids = tokens + [b""] * len(padding), sorted({*special, *padding})
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self._tokenizer, self._special = tokenizer, set(self.special_token_ids)

    def __call__(self, text):
        """The tokens that write `text`, up to the first one that does not write its next bytes: a
        vocabulary without byte fallback spells what it cannot write as an unknown token, which
        llguidance would take at its word (then refuse when committed). Cut there, the grammar's
        mask finds no token for those bytes, which `GrammarState` reports as such."""
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance then hands it str
        ids = self._tokenizer.encode_continuation(text, parse_special=False)
        wanted, at = text.encode("utf-8"), 0
        for n, i in enumerate(ids):
            written = self.tokens[i]
            if i in self._special or not written or not wanted.startswith(written, at):
                return ids[:n]
            at += len(written)
        return ids


def _token_bytes(engine, tokenizer, vocab_size: int, eos_ids: list[int]) -> tuple[list[bytes], set[int]]:
    """Each token's bytes and the special tokens' ids."""
    source = tokenizer.backend_json()
    if source is None:
        return tokenizer.token_bytes()
    try:
        read = engine.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos_ids)
    except ValueError as e:
        raise TokenizerError(f"constrained output needs llguidance to read this model's tokenizer, and it "
                             f"cannot: {e}") from None
    ids = range(tokenizer.vocab_size)
    return [read.decode_bytes([i]) for i in ids], {i for i in ids if read.is_special_token(i)}


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
        tokens, special = _token_bytes(engine, tokenizer, vocab_size, list(eos_ids))
        vocabulary = engine.TokenizerWrapper(_PlainTextVocabulary(tokenizer, tokens, special, vocab_size,
                                                                         tuple(eos_ids)))
        built[key] = engine.LLTokenizer(vocabulary, eos_token=list(eos_ids))
    return built[key]
