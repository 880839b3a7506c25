"""Text <-> token ids as transformers' tokenizers give them, without importing transformers.

tokenizer.json runs on `tokenizers` (what transformers' fast tokenizers wrap), tokenizer.model on
`sentencepiece`. A model folder's files become a `Tokenizer` in tokenizer_files.py, a GGUF file's metadata
in lucebox/checkpoints/gguf/tokenizer.py; chat templates render in chat_template.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers

from lucebox.errors import InvalidArgumentError, TokenizerError
from lucebox.text.chat_template import ChatTemplates

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: a code point no UTF-8 text holds


def _ids(value: Any) -> list[int]:
    # config files store bos/eos ids as an int, a list of ints, or null
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _content(token: Any) -> str | None:
    # special tokens are saved either as a plain string or as a serialized AddedToken dict
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


class Tokenizer:
    """A model's tokenizer; build it with `load_tokenizer` (tokenizer_files.py) or `tokenizer_from_gguf`."""

    def __init__(self, folder: Path, backend: tokenizers.Tokenizer | sentencepiece.SentencePieceProcessor,
                 tok_config: dict, config: dict, generation_config: dict | None,
                 templates: dict[str, str], template_source: str) -> None:
        self.folder = folder
        self._tk = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._plain: tokenizers.Tokenizer | None = None  # `_plain_tk`, made when first needed
        self._sp = backend if self._tk is None else None
        self._templates = ChatTemplates(templates, template_source)
        self._special = {k: _content(tok_config.get(k)) for k in _SPECIAL_KEYS}
        added = {int(i): d for i, d in (tok_config.get("added_tokens_decoder") or {}).items()
                 if str(i).isdigit() and isinstance(d, dict) and _content(d)}
        self._init_tokenizers(added) if self._tk is not None else self._init_sentencepiece(added, tok_config)
        gen = generation_config or {}
        eos = _ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id")) + self._named_id("eos_token")
        bos = _ids(gen.get("bos_token_id")) + _ids(config.get("bos_token_id")) + self._named_id("bos_token")
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.bos_token_id: int | None = bos[0] if bos else None

    def _named_id(self, key: str) -> list[int]:
        return _ids(self.token_to_id(self._special[key]) if self._special[key] else None)

    def _init_tokenizers(self, added: dict[int, dict]) -> None:
        # transformers adds the config's added tokens and named special tokens that tokenizer.json lacks
        have = {t.content for t in self._tk.get_added_tokens_decoder().values()}
        for _, d in sorted(added.items()):
            if d["content"] not in have:
                token = tokenizers.AddedToken(**{k: d[k] for k in _ADDED_TOKEN_FIELDS if k in d})
                (self._tk.add_special_tokens if d.get("special") else self._tk.add_tokens)([token])
                have.add(d["content"])
        missing = [c for c in self._special.values() if c and c not in have]
        self._tk.add_special_tokens([tokenizers.AddedToken(c, special=True, normalized=False)
                                     for c in missing])

    def _init_sentencepiece(self, added: dict[int, dict], tok_config: dict) -> None:
        sp = self._sp
        # a bare tokenizer.model still names its own <s>, </s>, <unk>, as transformers' Llama defaults do
        for key, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
            self._special[key] = self._special[key] or (sp.id_to_piece(i) if i >= 0 else None)
        self._added = {d["content"]: i for i, d in added.items()}  # text that never reaches sentencepiece
        self._special_ids = {i for i, d in added.items() if d.get("special", False)}
        for content in self._special.values():
            i = sp.piece_to_id(content) if content else sp.unk_id()
            if content and content not in self._added and (i != sp.unk_id() or sp.id_to_piece(i) == content):
                self._added[content] = i
                self._special_ids.add(i)
        self._added_by_id = {i: c for c, i in self._added.items()}
        self._split = _splitter(self._added)
        self._split_plain = _splitter([c for c, i in self._added.items() if i not in self._special_ids])
        self._add_bos = tok_config.get("add_bos_token", True) is not False
        self._add_eos = bool(tok_config.get("add_eos_token", False))
        self._legacy = bool(tok_config.get("legacy", False))
        self._unk_text = sp.id_to_piece(sp.unk_id())
        self._unk_ids = sp.encode(self._unk_text)
        self._unk_len = len(sp.decode(self._unk_ids))

    @property
    def vocab_size(self) -> int:
        if self._tk is not None:
            return self._tk.get_vocab_size(with_added_tokens=True)
        return max([self._sp.get_piece_size(), *(i + 1 for i in self._added_by_id)])

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse a tokenizer that can produce ids >= the model's `vocab_size` (they have no embedding row)."""
        if self._tk is not None:
            highest = max(self._tk.get_vocab(with_added_tokens=True).values(), default=-1)
        else:
            highest = self.vocab_size - 1
        if self.bos_token_id is not None:
            highest = max(highest, self.bos_token_id)
        if highest >= vocab_size:
            raise TokenizerError(
                f"the tokenizer in {self.folder} has token id {highest}, but the model's vocabulary is "
                f"{vocab_size} tokens (config.json vocab_size); the tokenizer files do not belong to this model")

    @property
    def has_chat_template(self) -> bool:
        return "default" in self._templates

    def token_to_id(self, tok: str) -> int | None:
        if self._tk is not None:
            return self._tk.token_to_id(tok)
        if tok in self._added:
            return self._added[tok]
        i = self._sp.piece_to_id(tok)
        return None if i == self._sp.unk_id() and self._sp.id_to_piece(i) != tok else i

    def id_to_token(self, i: int) -> str | None:
        if self._tk is not None:
            return self._tk.id_to_token(i)
        if i in self._added_by_id:
            return self._added_by_id[i]
        return self._sp.id_to_piece(i) if 0 <= i < self._sp.get_piece_size() else None

    def backend_json(self) -> str | None:
        """tokenizer.json's text as the `tokenizers` backend holds it (added tokens included), or None
        for a sentencepiece model (then `token_bytes` describes the vocabulary)."""
        return self._tk.to_str() if self._tk is not None else None

    def token_bytes(self) -> tuple[list[bytes], set[int]]:
        """A sentencepiece vocabulary as a grammar engine needs it: each id's bytes in decoded text
        (U+2581 is a space, <0x0A> the byte it names) and the ids of special tokens (kept as names)."""
        sp, tokens, special = self._sp, [], set(self._special_ids)
        for i in range(self.vocab_size):
            piece = self.id_to_token(i) or ""
            if i >= sp.get_piece_size() or i in self._added_by_id:
                tokens.append(piece.encode())
            elif sp.is_byte(i):
                tokens.append(bytes([int(piece[3:-1], 16)]))
            else:
                tokens.append(piece.replace("\u2581", " ").encode())
                if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                    special.add(i)
        return tokens, special

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_text(text)
        if self._tk is not None:
            # the tokenizer.json post-processor decides about BOS/EOS, as in transformers' fast tokenizers
            return self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text) if self._split else [text]):
            if k % 2:  # re.split puts the matched added tokens at odd positions
                ids.append(self._added[part])
            elif part and (k == 0 or self._legacy):
                ids += self._sp.encode(part)
            elif part:
                # Text after an added token gets no dummy-prefix space (transformers' legacy=False Llama)
                ids += self._sp_inner(part)
        if add_special_tokens and self._add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_special_tokens and self._add_eos:
            ids += self._named_id("eos_token")  # the tokenizer's own EOS, not generation_config's stop ids
        return ids

    def _sp_inner(self, text: str) -> list[int]:
        """sentencepiece ids of text that continues other text: encoded behind "<unk>", dropping the
        ids "<unk>" alone encodes to, so no dummy-prefix space is added."""
        full, n = self._sp.encode(self._unk_text + text), len(self._unk_ids)
        return full[n:] if full[:n] == self._unk_ids else self._sp.encode(text)

    def encode_continuation(self, text: str, parse_special: bool = True) -> list[int]:
        """Ids of `text` as it continues a sequence already tokenized (a chat's next turn): no BOS or
        EOS, no leading space added, added tokens (<|im_start|>, ...) recognized. parse_special=False
        reads special tokens' names (</s>, [TOOL_CALLS]) as text, spelled with ordinary tokens: what
        a grammar's literal text is, since the grammar engine never lets a special token write text."""
        _check_text(text)
        if not text:
            return []
        if self._tk is not None:
            return (self._tk if parse_special else self._plain_tk()).encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        split = self._split if parse_special else self._split_plain
        for k, part in enumerate(split.split(text) if split else [text]):
            if k % 2:
                ids.append(self._added[part])
            elif part:
                ids += self._sp_inner(part)
        return ids

    def _plain_tk(self) -> tokenizers.Tokenizer:
        """A copy of the `tokenizers` backend that encodes special tokens' names as text."""
        if self._plain is None:
            self._plain = tokenizers.Tokenizer.from_str(self._tk.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._tk is not None:
            return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
        sp, n, out, run = self._sp, self._sp.get_piece_size(), [], []

        def close_run() -> None:
            if run:
                # sentencepiece drops a leading space, right only at the start of the text: elsewhere decode
                # behind "<unk>" and cut its text off
                out.append(sp.decode(self._unk_ids + run)[self._unk_len:] if out else sp.decode(run))
                run.clear()

        for i in ids:
            if i in self._added_by_id or not 0 <= i < n or sp.is_control(i):
                if skip_special_tokens and (i in self._special_ids or (0 <= i < n and sp.is_control(i))):
                    continue
                close_run()
                out.append(self.id_to_token(i) or "")
            else:
                run.append(i)
        close_run()
        return "".join(out)

    def chat_template(self, tools: bool = False) -> str | None:
        """The source of the chat template `apply_chat_template` renders (with `tools` given, or not)."""
        return self._templates.text("tool_use" if tools and "tool_use" in self._templates else "default")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        name = "tool_use" if kwargs.get("tools") is not None and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise TokenizerError(
                f"the model in {self.folder} has no chat template (no chat_template.jinja, no chat_template "
                "in tokenizer_config.json); pass a raw prompt string or token ids instead")
        variables = {**{k: v or "" for k, v in self._special.items()}, "tools": None, "documents": None}
        return self._templates.render(name, messages, {**variables, **kwargs,
                                                       "add_generation_prompt": add_generation_prompt})


def _splitter(words) -> re.Pattern | None:
    """A pattern whose split puts each of `words` (the longest first) at the odd positions."""
    longest = "|".join(map(re.escape, sorted(words, key=len, reverse=True)))
    return re.compile(f"({longest})") if longest else None


def _check_text(text: str) -> None:
    """Text is checked here, where all of it passes on its way to the model (a prompt, a chat turn, a
    loaded conversation, a request to the server), before either backend sees it: sentencepiece and
    tokenizers fail on a lone surrogate with errors of their own that name nothing."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"text to tokenize must be a str, got {type(text).__name__}")
    found = _SURROGATE.search(text)
    if found:
        at = found.start()
        raise InvalidArgumentError(
            f"the text holds a lone surrogate U+{ord(found.group()):04X} at character {at} (in "
            f"{text[max(at - 20, 0):at + 20]!r}): not valid Unicode (input bytes that were not UTF-8, or a "
            "\\ud800-style escape); remove it or replace it")


def require_tokenizer(tok: Tokenizer | None, folder: str | Path | None = None) -> Tokenizer:
    """`tok`, or a TokenizerError telling the user to pass token ids when the checkpoint has no tokenizer."""
    if tok is None:
        where = f" in {folder}" if folder is not None else ""
        raise TokenizerError(
            f"this checkpoint has no tokenizer files (tokenizer.json or tokenizer.model){where}; "
            "pass token ids instead of text, or add the tokenizer files")
    return tok
