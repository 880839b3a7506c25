"""The tokenizer of a llama.cpp GGUF file, rebuilt from its `tokenizer.ggml.*` metadata.

"gpt2" files (byte-level BPE) become a `tokenizers` BPE split by the regex llama.cpp picks for
`tokenizer.ggml.pre`; "llama" files (SentencePiece) become a sentencepiece model made of the file's
own pieces, scores and types. Either goes to lucebox.text.tokenizer.Tokenizer, as a model folder's would.
What each key means, and its default when absent, follows llama.cpp's src/llama-vocab.cpp.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from lucebox.errors import TokenizerError
from lucebox.text.tokenizer import Tokenizer

# gguf-py's TokenType; sentencepiece's SentencePiece.Type uses the same numbers, so "llama" types pass through
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPECIAL_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)  # split out of text before BPE, as llama.cpp does

# The models' own split regexes (from their tokenizer.json); llama.cpp runs hand-expanded copies of them
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen splits numbers into single digits
# llama.cpp's "default": regexes applied one after another, each splitting the pieces the last one left
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
            r"\p{N}+", "[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes, ignore_merges, add_bos when add_bos_token is absent), as llama.cpp sets them.
# Names llama.cpp does not know it runs with "default" and a warning; here they are refused instead.
_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), ((_LLAMA3,), True, True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), ((_QWEN2,), False, False)),
    **dict.fromkeys(("gpt-2", "phi-2"), ((_GPT2,), False, False)),
}


def tokenizer_from_gguf(metadata: dict[str, object], source: Path) -> Tokenizer | None:
    """The tokenizer stored in a GGUF file's metadata (every key -> a plain value), or None when the file
    has no `tokenizer.ggml.model`. `source` is the .gguf path, for messages."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return None
    meta = _Metadata(metadata, Path(source))
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"{source}: tokenizer.ggml.model is {model!r}; lucebox reads only 'gpt2' "
                             "(byte-level BPE) and 'llama' (SentencePiece) tokenizers")
    tokens, types, scores = _vocabulary(meta)
    spm = model == "llama"
    # llama.cpp's defaults for ids a "llama" file leaves out; a "gpt2" one's (11, GPT-2's ",") are not followed
    ids = {k: meta.token_id(k, len(tokens), d if spm else None) for k, d in
           (("bos", 1), ("eos", 2), ("unknown", 0), ("padding", None), ("eot", None), ("eom", None))}
    if spm:
        add_bos = True
        backend, legacy = _sentencepiece(meta, tokens, scores, types, ids)
    else:
        regexes, ignore_merges, add_bos = _pre_tokenizer(meta)
        backend, legacy = _byte_level_bpe(meta, tokens, regexes, ignore_merges), False
    add_bos = meta.flag("add_bos_token", add_bos)
    add_eos = meta.flag("add_eos_token", False)
    if not spm:
        _add_bos_eos(backend, tokens, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)
    tok_config = _tok_config(tokens, types, ids)
    tok_config.update(add_bos_token=add_bos, add_eos_token=add_eos, legacy=legacy)
    eos = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]  # llama.cpp stops on each of them
    config = {"bos_token_id": ids["bos"], "eos_token_id": eos}
    templates = _chat_templates(meta)
    return Tokenizer(meta.source, backend, tok_config, config, None, templates, f"{source} (tokenizer.chat_template)")


def _vocabulary(meta: _Metadata) -> tuple[list[str], list[int], list[float]]:
    """The tokens (empty ones renamed, as llama.cpp does), their types and their scores, each checked."""
    tokens = meta.strings("tokens")
    n = len(tokens)
    if not n:
        raise TokenizerError(f"{meta.source}: tokenizer.ggml.tokens is missing or empty")
    types = meta.numbers("token_type", n, int) or [NORMAL] * n
    scores = meta.numbers("scores", n, float) or [0.0] * n  # only SentencePiece uses them; llama.cpp reads n
    if any(t not in range(0, 7) for t in types):
        raise TokenizerError(f"{meta.source}: tokenizer.ggml.token_type holds a type outside 0..6")
    # llama.cpp renames empty tokens the same way; a repeated token would leave two ids with one text
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise TokenizerError(f"{meta.source}: tokenizer.ggml.tokens holds {dup!r} twice")
    return tokens, types, scores


def _pre_tokenizer(meta: _Metadata) -> tuple[tuple[str, ...], bool, bool]:
    """A "gpt2" file's `_PRE` entry, named by tokenizer.ggml.pre."""
    pre = meta.metadata.get("tokenizer.ggml.pre")
    if pre is None:
        raise TokenizerError(f"{meta.source} has no tokenizer.ggml.pre, so how its BPE splits text is unknown "
                             "(llama.cpp guesses 'default' and warns of degraded output); re-convert it with "
                             "a current llama.cpp")
    if pre not in _PRE:
        raise TokenizerError(f"{meta.source}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer lucebox does not know "
                             f"(known: {', '.join(sorted(_PRE))}); its text splitting cannot be reproduced")
    return _PRE[pre]


def _tok_config(tokens: list[str], types: list[int], ids: dict[str, int | None]) -> dict[str, Any]:
    """The named and added tokens, as a model folder's tokenizer_config.json would hold them."""
    tok_config: dict[str, Any] = {
        f"{k}_token": tokens[ids[key]] for k, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"))
        if ids[key] is not None}
    # control (and unknown) tokens are special: skipped by decode; user-defined ones are text that never splits
    tok_config["added_tokens_decoder"] = {
        str(i): {"content": t, "special": ty != USER_DEFINED, "normalized": False}
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty in _SPECIAL_TYPES}
    return tok_config


def _chat_templates(meta: _Metadata) -> dict[str, str]:
    """tokenizer.chat_template as "default", and each tokenizer.chat_template.<name> as <name>."""
    metadata = meta.metadata
    templates = {"default": metadata["tokenizer.chat_template"]} if "tokenizer.chat_template" in metadata else {}
    prefix = "tokenizer.chat_template."
    templates.update({k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix)})
    bad = next((name for name, t in templates.items() if not isinstance(t, str)), None)
    if bad is not None:
        key = "tokenizer.chat_template" + ("" if bad == "default" else f".{bad}")
        raise TokenizerError(f"{meta.source}: {key} holds a {type(templates[bad]).__name__}, not a string")
    return templates


class _Metadata:
    """Typed reads of `tokenizer.ggml.<name>` keys; each wrong value is a TokenizerError naming its key."""

    def __init__(self, metadata: dict[str, object], source: Path) -> None:
        self.metadata, self.source = metadata, source

    def error(self, name: str, why: str) -> TokenizerError:
        """The error for key tokenizer.ggml.<name>, saying `why` it is wrong (raise it)."""
        return TokenizerError(f"{self.source}: tokenizer.ggml.{name} {why}; the file is damaged or was not "
                              "written by llama.cpp's converter")

    def strings(self, name: str) -> list[str]:
        value = self.metadata.get(f"tokenizer.ggml.{name}", [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(name, "is not a list of strings")
        return value

    def numbers(self, name: str, n: int, kind: type) -> list | None:
        value = self.metadata.get(f"tokenizer.ggml.{name}")
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and (kind is float or isinstance(v, int)) for v in value):
            raise self.error(name, f"is not a list of {kind.__name__}s")
        if len(value) != n:
            raise self.error(name, f"has {len(value)} entries for {n} tokens (tokenizer.ggml.tokens)")
        return [kind(v) for v in value]

    def token_id(self, name: str, n: int, default: int | None) -> int | None:
        key = f"{name}_token_id"
        value = self.metadata.get(f"tokenizer.ggml.{key}", default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise self.error(key, f"is {value!r}, not a token id below {n}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.metadata.get(f"tokenizer.ggml.{name}", default)
        if not isinstance(value, bool):
            raise self.error(name, f"is {value!r}, not true or false")
        return value


def _byte_level_bpe(meta: _Metadata, tokens: list[str], regexes: tuple[str, ...],
                    ignore_merges: bool) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" not in meta.metadata:
        raise meta.error("merges", "is missing (a 'gpt2' tokenizer needs its merges)")
    merges = []
    for k, merge in enumerate(meta.strings("merges")):
        # byte-level tokens hold no plain space, so the first space after position 0 separates the pair
        cut = merge.find(" ", 1)
        a, b = merge[:cut], merge[cut + 1:]
        if cut < 0 or a not in vocab or b not in vocab or a + b not in vocab:
            raise meta.error("merges", f"entry {k} ({merge!r}) names a pair or result not in tokenizer.ggml.tokens")
        merges.append((a, b))
    tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    # split the raw text by each regex in turn (llama.cpp keeps the unmatched gaps too), then map bytes
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _add_bos_eos(tk: tokenizers.Tokenizer, tokens: list[str], bos: int | None, eos: int | None) -> None:
    # the tokenizers backend adds BOS/EOS in its post-processor (lucebox.Tokenizer.encode relies on that)
    if bos is None and eos is None:
        return
    # pieces as a list, not a template string: a token's text may hold spaces
    single = [tokens[i] for i in (bos,) if i is not None] + ["$A"] + [tokens[i] for i in (eos,) if i is not None]
    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    tk.post_processor = processors.TemplateProcessing(single=single, special_tokens=ends)


def _sentencepiece(meta: _Metadata, tokens: list[str], scores: list[float], types: list[int],
                   ids: dict[str, int | None]) -> tuple[sentencepiece.SentencePieceProcessor, bool]:
    """A sentencepiece BPE model of exactly these pieces, and whether text after an added token gets the
    dummy-prefix space (llama.cpp adds it there whenever add_space_prefix is on: transformers' legacy mode)."""
    prefix = meta.flag("add_space_prefix", True)
    if UNKNOWN not in types:  # llama.cpp needs no unknown-typed token, sentencepiece does: the unk id's is it
        types = [UNKNOWN if i == ids["unknown"] else t for i, t in enumerate(types)]
    # sentencepiece_model.proto field numbers: ModelProto pieces=1, trainer_spec=2, normalizer_spec=3;
    # SentencePiece piece=1, score=2 (float), type=3; TrainerSpec model_type=3, byte_fallback=35,
    # unk/bos/eos_piece=45/46/47; NormalizerSpec name=1, add_dummy_prefix=3, remove_extra_whitespaces=4
    proto = bytearray()
    for piece, score, ty in zip(tokens, scores, types, strict=True):
        proto += _field(1, _string(1, piece) + _tag(2, 5) + struct.pack("<f", score) + _varint_field(3, ty or NORMAL))
    trainer = _varint_field(3, 2) + _varint_field(35, int(BYTE in types))  # model_type=BPE, byte_fallback
    for field, key in ((45, "unknown"), (46, "bos"), (47, "eos")):
        if ids[key] is not None:
            trainer += _string(field, tokens[ids[key]])
    # llama.cpp normalizes nothing for SentencePiece: no charsmap, whitespace kept as it is
    normalizer = _string(1, "identity") + _varint_field(3, int(prefix)) + _varint_field(4, 0)
    proto += _field(2, trainer) + _field(3, normalizer)
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(bytes(proto))
    except Exception as e:  # sentencepiece raises plain RuntimeError/OSError on a model it rejects
        raise meta.error("tokens", f"does not make a valid SentencePiece model ({str(e)[:200]})") from None
    return sp, prefix


# The few protobuf wire-format pieces a sentencepiece ModelProto needs (no protobuf dependency)
def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _varint_field(field: int, v: int) -> bytes:
    return _tag(field, 0) + _varint(v)


def _field(field: int, payload: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(payload)) + payload


def _string(field: int, s: str) -> bytes:
    return _field(field, s.encode("utf-8"))
