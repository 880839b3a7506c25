"""Text <-> token ids for a Hugging Face model folder, without importing transformers.

tokenizer.json runs on `tokenizers` (what transformers' fast tokenizers wrap), tokenizer.model on
`sentencepiece`; chat templates render in transformers' jinja2 setup, so prompts come out the same as there.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import sentencepiece
import tokenizers

from lucebox.checkpoints.hf_folder import inside_folder
from lucebox.errors import ModelNotFoundError, TokenizerError

_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON ({e}); re-download or delete it") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _ids(value: Any) -> list[int]:
    # config files store bos/eos ids as an int, a list of ints, or null
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _content(token: Any) -> str | None:
    # special tokens are saved either as a plain string or as a serialized AddedToken dict
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# A chat template comes from a stranger's model folder: it renders in a sandbox (no attribute
# escapes), within a time limit and an output size, and no single operation may build a value
# larger than the output could hold ('a' * 10**10, 10 ** 10 ** 10, '%999999999d' % 1).
TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 16 * 2**20


class _TemplateTimeout(Exception):
    """Raised inside a rendering thread whose template ran past TEMPLATE_SECONDS."""


def _too_big(size: int) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise jinja2.exceptions.SecurityError(f"the template builds a value of {size} items "
                                              f"(the limit is {TEMPLATE_MAX_CHARS})")


_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\*|\d{5,})|%[-#0 +]*\d*\.(\*|\d{5,})|\{[^}]*\d{5,}")


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _too_big(len(seq) * times)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and max(abs(left).bit_length(), 1) * abs(right) > 2**20):
            raise jinja2.exceptions.SecurityError("the template computes a number of more than 2**20 bits")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise jinja2.exceptions.SecurityError("the template formats with a field width of 10000 or more")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _check_sizes(args, kwargs)  # 'x'.ljust(10**9), 'x'.zfill(10**9), range(...) is already bounded
        return super().call(__context, __obj, *args, **kwargs)


def _check_sizes(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _too_big(abs(value))


def _bounded_filter(f):
    """A filter that refuses integer arguments beyond the output limit (center(10**9), indent(10**9))."""
    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_sizes(args[1:], kwargs)
        return f(*args, **kwargs)

    return bounded


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    if _WIDE_FORMAT.search(str(value)):
        raise jinja2.exceptions.SecurityError("the template formats with a field width of 10000 or more")
    return str(value) % (kwargs or args)


# The same environment transformers builds: templates come from the Hub, hence the sandbox.
_JINJA = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
_JINJA.filters["format"] = _format
_JINJA.filters.update({name: _bounded_filter(f) for name, f in _JINJA.filters.items()})
# jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON, as transformers gives them
_JINJA.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
    json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))
_JINJA.globals["raise_exception"] = _raise_exception
_JINJA.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


class Tokenizer:
    """A model folder's tokenizer; build it with `load_tokenizer`."""

    def __init__(self, folder: Path, backend: tokenizers.Tokenizer | sentencepiece.SentencePieceProcessor,
                 tok_config: dict, config: dict, generation_config: dict | None,
                 templates: dict[str, str], template_source: str) -> None:
        self.folder = folder
        self._tk = backend if isinstance(backend, tokenizers.Tokenizer) else None
        self._sp = backend if self._tk is None else None
        self._templates, self._template_source, self._compiled = templates, template_source, {}
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
        longest = "|".join(map(re.escape, sorted(self._added, key=len, reverse=True)))
        self._split = re.compile(f"({longest})") if longest else None
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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

    def encode_continuation(self, text: str) -> list[int]:
        """Ids of `text` as it continues a sequence already tokenized (a chat's next turn): no BOS or
        EOS, no leading space added, added tokens (<|im_start|>, ...) recognized."""
        if not text:
            return []
        if self._tk is not None:
            return self._tk.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for k, part in enumerate(self._split.split(text) if self._split else [text]):
            if k % 2:
                ids.append(self._added[part])
            elif part:
                ids += self._sp_inner(part)
        return ids

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        name = "tool_use" if kwargs.get("tools") is not None and "tool_use" in self._templates else "default"
        if name not in self._templates:
            raise TokenizerError(
                f"the model in {self.folder} has no chat template (no chat_template.jinja, no chat_template "
                "in tokenizer_config.json); pass a raw prompt string or token ids instead")
        try:
            if name not in self._compiled:
                self._compiled[name] = _JINJA.from_string(self._templates[name])
            chat = []
            for m in messages:
                # like transformers: None-valued keys are dropped (templates print "None" or crash on them)
                # and reasoning is visible under every name templates read it by
                m = {k: v for k, v in m.items() if v is not None}
                r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
                chat.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
            variables = {**{k: v or "" for k, v in self._special.items()}, "tools": None, "documents": None}
            return _render_bounded(self._compiled[name], {**variables, **kwargs, "messages": chat,
                                                          "add_generation_prompt": add_generation_prompt})
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template from {self._template_source}: {e}") from e
        except _TemplateTimeout:
            raise TokenizerError(f"chat template from {self._template_source} ran longer than {TEMPLATE_SECONDS} s; "
                                 "the template is broken or hostile: fix or replace it") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, MemoryError,
                RecursionError) as e:
            # templates can fail in plain Python ways too (a number added to a string, a huge range)
            raise TokenizerError(f"chat template from {self._template_source} failed: "
                                 f"{type(e).__name__}: {str(e)[:200]}") from None


def _render_bounded(template: jinja2.Template, variables: dict) -> str:
    """Render with the output cut at TEMPLATE_MAX_CHARS and the time at TEMPLATE_SECONDS. The time
    limit is a timer that raises _TemplateTimeout in the rendering thread (between two Python
    bytecodes, so also inside a loop that writes nothing); single operations are bounded by the
    sandbox's operator checks."""
    thread, lock, state = threading.get_ident(), threading.Lock(), {"rendering": True, "fired": False}

    def expire() -> None:
        with lock:
            if state["rendering"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                           ctypes.py_object(_TemplateTimeout))

    timer = threading.Timer(TEMPLATE_SECONDS, expire)
    timer.daemon = True
    timer.start()
    try:
        pieces, size = [], 0
        for piece in template.generate(variables):
            size += len(piece)
            if size > TEMPLATE_MAX_CHARS:
                raise jinja2.exceptions.SecurityError(f"the template writes more than {TEMPLATE_MAX_CHARS} "
                                                      "characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        with lock:
            state["rendering"] = False
            if state["fired"]:  # the exception may still be pending: cancel it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
        timer.cancel()


def load_tokenizer(folder: Path, config: dict, generation_config: dict | None,
                   vocab_size: int | None = None) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has neither tokenizer.json nor tokenizer.model. With
    `vocab_size` (the model's), a tokenizer that can produce an id the model has no row for is refused."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    json_file, sp_file = folder / "tokenizer.json", folder / "tokenizer.model"
    if not json_file.is_file() and not sp_file.is_file():
        return None  # token ids still work; require_tokenizer explains when text is needed
    for name in (*_FILES, "chat_template.jinja"):
        if (folder / name).exists():
            inside_folder(folder, name, folder)  # a link out of the folder is refused
    tok_config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    # transformers reads special_tokens_map.json only for configs without added_tokens_decoder, and lets it
    # win there; elsewhere it is a fallback at most
    has_added = "added_tokens_decoder" in tok_config
    tok_config = {**special_map, **tok_config} if has_added else {**tok_config, **special_map}
    path = json_file if json_file.is_file() else sp_file
    try:
        if path is json_file:
            backend = tokenizers.Tokenizer.from_file(str(path))
        else:
            backend = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # both libraries raise plain Exception/RuntimeError on a bad file
        raise TokenizerError(f"{path} cannot be parsed ({e}); re-download it") from e
    templates, source, jinja_file = {}, folder / "tokenizer_config.json", folder / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file
        try:
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file} cannot be read ({e})") from e
    elif isinstance(tok_config.get("chat_template"), str):
        templates["default"] = tok_config["chat_template"]
    elif isinstance(tok_config.get("chat_template"), list):
        templates = {t["name"]: t["template"] for t in tok_config["chat_template"]
                     if isinstance(t, dict) and isinstance(t.get("template"), str)}
    try:
        tokenizer = Tokenizer(folder, backend, tok_config, config, generation_config, templates, str(source))
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise TokenizerError(f"the tokenizer files in {folder} hold a value of the wrong type or form "
                             f"({type(e).__name__}: {str(e)[:200]}); re-download them") from None
    if vocab_size is not None:
        tokenizer.check_vocabulary(vocab_size)
    return tokenizer


def require_tokenizer(tok: Tokenizer | None, folder: str | Path | None = None) -> Tokenizer:
    """`tok`, or a TokenizerError telling the user to pass token ids when the checkpoint has no tokenizer."""
    if tok is None:
        where = f" in {folder}" if folder is not None else ""
        raise TokenizerError(
            f"this checkpoint has no tokenizer files (tokenizer.json or tokenizer.model){where}; "
            "pass token ids instead of text, or add the tokenizer files")
    return tok


class IncrementalDecoder:
    """Streams generated ids as text: pushes + flush() == decode(generated ids) when prompt_ids is ().

    Each push decodes a window starting before the new ids and returns the text past its old end (vLLM's
    scheme), so sentencepiece's leading space sees its neighbour. Text ending in U+FFFD is an unfinished UTF-8
    character and waits for the next ids. With prompt_ids the output is what generation appends to the decoded
    prompt: the same for byte-level BPE, but sentencepiece then keeps the first token's leading space.
    """

    _CONTEXT = 5  # prompt ids kept as context, as vLLM does

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        # _ids[:_read] is text already returned (or prompt); it is the window's context for the next push
        self._ids = [int(i) for i in list(prompt_ids)[-self._CONTEXT:]]
        self._read = len(self._ids)

    def _advance(self, final: bool) -> str:
        before = self._tok.decode(self._ids[:self._read], skip_special_tokens=self._skip)
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return ""
        # the ids just turned into text are the next window's context; older ids are no longer needed
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return text[len(before):]

    def push(self, ids: Sequence[int]) -> str:
        """Adds generated ids; returns the text they finished (possibly "")."""
        self._ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Returns whatever is held back (an unfinished character decodes to U+FFFD here)."""
        return self._advance(final=True)
