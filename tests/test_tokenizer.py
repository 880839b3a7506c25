"""lucebox.text's tokenizer against transformers (the reference) on tokenizers built here, in tmp folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from lucebox.errors import InvalidArgumentError, ModelNotFoundError, TokenizerError
from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.tokenizer import Tokenizer, require_tokenizer
from lucebox.text.tokenizer_files import load_tokenizer

CORPUS = [
    "héllo wörld 你好 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "hello world, hello there! Streaming text: it's fine.",
    "Multi-byte characters like é, ö, 你, 好 and 🙂 must stream correctly.",
] * 10
# 日本 and 🎉 are not in the corpus: sentencepiece spells them with byte-fallback pieces
TEXT = "héllo wörld 你好 🙂 — 日本 🎉 and  two spaces\nnew line"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief <&>."}, {"role": "user", "content": "héllo 你好 🙂"}]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "a < b & 'c'", "parameters": {}}}]


def _write(folder: Path, name: str, data: object) -> None:
    (folder / name).write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}  # the older, dict spelling
    _write(folder, "tokenizer_config.json", {"bos_token": "<s>", "eos_token": eos, "chat_template": CHATML})
    return folder


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sp")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(folder / "tokenizer"), vocab_size=340,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2)
    # two added tokens past the sentencepiece vocab, as chat-tuned Llama-style checkpoints have
    added = {str(i): {"content": c, "special": True} for i, c in ((340, "<|im_start|>"), (341, "<|im_end|>"))}
    _write(folder, "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                             "added_tokens_decoder": added})
    return folder


def test_bpe_matches_transformers(bpe_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(bpe_dir)
    ref_file = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    tok = load_tokenizer(bpe_dir, {}, None)
    assert isinstance(tok, Tokenizer)
    for text in (TEXT, "", "<|im_start|>user\nhi<|im_end|>"):
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special)
            assert ids == ref_file.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.encode("hi")[0] == tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token_ids == (ref.eos_token_id,)
    assert tok.vocab_size == len(ref)
    assert tok.token_to_id("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")
    assert tok.token_to_id("no-such-token") is None
    assert tok.has_chat_template
    for kwargs in ({}, {"tools": TOOLS}):
        for gen in (True, False):
            ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, **kwargs)
            theirs = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen, **kwargs)
            assert ours == theirs
    assert '"a < b & \'c\'"' in tok.apply_chat_template(MESSAGES, tools=TOOLS)  # tojson does not HTML-escape


def test_sentencepiece_matches_library(sp_dir: Path, tmp_path: Path) -> None:
    # transformers 5 loads a bare tokenizer.model only by converting it, which needs protobuf (not installed
    # here), so the reference is the sentencepiece library itself plus hand-computed BOS and added tokens.
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    tok = load_tokenizer(sp_dir, {}, None)
    assert tok is not None and tok.bos_token_id == sp.bos_id() and tok.eos_token_ids == (sp.eos_id(),)
    assert tok.encode(TEXT) == [sp.bos_id(), *sp.encode(TEXT)]
    assert tok.encode(TEXT, add_special_tokens=False) == sp.encode(TEXT)
    assert tok.decode(tok.encode(TEXT)) == sp.decode(sp.encode(TEXT)) == TEXT
    assert tok.vocab_size == 342 and tok.token_to_id("<|im_end|>") == 341 and tok.token_to_id("</s>") == 2
    # added tokens are split out of the text; text after one gets no dummy-prefix space (legacy=False)
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[:2] == [sp.bos_id(), 340] and ids[-1] == 341
    assert sp.id_to_piece(ids[2]) != "\u2581" and not sp.id_to_piece(ids[2]).startswith("\u2581")
    assert tok.decode(ids) == "user\nhello"
    assert tok.decode(ids, skip_special_tokens=False) == "<s><|im_start|>user\nhello<|im_end|>"
    # the dummy-prefix space is dropped only at the start of the text, as in transformers
    assert tok.decode([340, *sp.encode("hi")], skip_special_tokens=False) == "<|im_start|> hi"
    assert tok.decode([*sp.encode("hi"), 341, *sp.encode("hi")]) == "hi hi"
    (tmp_path / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    _write(tmp_path, "tokenizer_config.json", {"add_bos_token": False, "add_eos_token": True})
    tok = load_tokenizer(tmp_path, {}, None)
    assert tok is not None and tok.encode("hello") == [*sp.encode("hello"), sp.eos_id()]


def test_sentencepiece_matches_transformers_llama(sp_dir: Path) -> None:
    # transformers 5 turns a tokenizer.model into its Llama tokenizer (BPE with byte fallback, Metaspace with
    # prepend_scheme="first"); converting needs protobuf, so build that tokenizer here from the same vocab.
    transformers = pytest.importorskip("transformers")
    generate_merges = pytest.importorskip("transformers.tokenization_utils_base").generate_merges
    sp = spm.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    ref = transformers.LlamaTokenizer(vocab=vocab, merges=generate_merges(vocab, scores), add_bos_token=True)
    ref.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok = load_tokenizer(sp_dir, {}, None)
    chat = "<|im_start|>user\nhéllo 🎉<|im_end|>\n<|im_start|>assistant\n"
    for text in (TEXT, chat, "a<s>b</s>  c", "日本", ""):
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    # Known difference: for text that starts with a space, sentencepiece (followed here) adds its dummy-prefix
    # space anyway, while transformers' Metaspace does not add one to text that already starts with one.
    assert tok.encode(" hello", add_special_tokens=False) == sp.encode(" hello")
    assert tok.encode(" hello") != ref.encode(" hello")


@pytest.mark.parametrize("backend", ["bpe_dir", "sp_dir"])
def test_a_lone_surrogate_is_refused_by_position_before_either_backend_sees_it(backend, request):
    tok = load_tokenizer(request.getfixturevalue(backend), {}, None)
    for encode in (tok.encode, tok.encode_continuation):
        with pytest.raises(InvalidArgumentError, match=r"lone surrogate U\+DCFF at character 5 \(in 'hello\\udcff"):
            encode("hello\udcff world")
    assert tok.decode(tok.encode("hi \U0001f642")) == "hi \U0001f642"  # a whole character beyond U+FFFF is fine


def test_eos_union_dedup_and_bos_order(bpe_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    tok = load_tokenizer(tmp_path, {"eos_token_id": 3, "bos_token_id": 7}, {"eos_token_id": [2, 3]})
    eos = tok.token_to_id("</s>")
    assert eos not in (2, 3)
    assert tok.eos_token_ids == (2, 3, eos)
    assert tok.bos_token_id == 7
    tok = load_tokenizer(tmp_path, {"eos_token_id": [eos, eos]}, {"bos_token_id": 5, "eos_token_id": None})
    assert tok.eos_token_ids == (eos,) and tok.bos_token_id == 5
    tok = load_tokenizer(tmp_path, {}, None)
    assert tok.bos_token_id == tok.token_to_id("<s>")
    # without tokenizer_config.json, special_tokens_map.json names the special tokens
    (tmp_path / "tokenizer_config.json").unlink()
    _write(tmp_path, "special_tokens_map.json", {"eos_token": {"content": "<|im_end|>"}})
    tok = load_tokenizer(tmp_path, {"eos_token_id": 1}, None)
    assert tok.eos_token_ids == (1, tok.token_to_id("<|im_end|>")) and tok.bos_token_id is None
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).eos_token == "<|im_end|>"


def test_chat_template_sources(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    listed = [{"name": "tool_use", "template": "TOOLS"},
              {"name": "default", "template": "DEFAULT {{ eos_token }}"}]
    _write(tmp_path, "tokenizer_config.json", {"eos_token": "</s>", "chat_template": listed})
    tok = load_tokenizer(tmp_path, {}, None)
    assert tok.apply_chat_template(MESSAGES) == "DEFAULT </s>"
    assert tok.apply_chat_template(MESSAGES, tools=TOOLS) == "TOOLS"
    _write(tmp_path, "chat_template.jinja", "FILE {{ messages | length }}{{ bos_token }}")
    tok = load_tokenizer(tmp_path, {}, None)
    assert tok.apply_chat_template(MESSAGES) == "FILE 2"  # the file wins; no bos_token known -> ""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ref.apply_chat_template(MESSAGES, tokenize=False) == "FILE 2"


def test_missing_template_and_raise_exception(bpe_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path, {}, None)
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
    _write(tmp_path, "chat_template.jinja", "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TokenizerError, match="roles must alternate"):
        load_tokenizer(tmp_path, {}, None).apply_chat_template(MESSAGES)
    _write(tmp_path, "chat_template.jinja", "{% if %}")
    with pytest.raises(TokenizerError, match="chat_template.jinja"):
        load_tokenizer(tmp_path, {}, None).apply_chat_template(MESSAGES)


def test_no_tokenizer_files(tmp_path: Path) -> None:
    _write(tmp_path, "config.json", {})
    assert load_tokenizer(tmp_path, {}, None) is None
    with pytest.raises(TokenizerError, match="no tokenizer files.*pass token ids"):
        require_tokenizer(None)
    with pytest.raises(TokenizerError, match=str(tmp_path.name)):
        require_tokenizer(load_tokenizer(tmp_path, {}, None), tmp_path)
    with pytest.raises(ModelNotFoundError):
        load_tokenizer(tmp_path / "absent", {}, None)


def test_corrupt_files(bpe_dir: Path, tmp_path: Path) -> None:
    _write(tmp_path, "tokenizer.json", '{"model": ')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path, {}, None)
    _write(tmp_path, "tokenizer.json", '{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path, {}, None)
    (tmp_path / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    _write(tmp_path, "tokenizer_config.json", "{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path, {}, None)
    sp_only = tmp_path / "sp"
    sp_only.mkdir()
    (sp_only / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        load_tokenizer(sp_only, {}, None)
    assert require_tokenizer(load_tokenizer(bpe_dir, {}, None)) is not None


@pytest.mark.parametrize("kind", ["bpe", "sp"])
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_decoder(kind: str, step: int, bpe_dir: Path, sp_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir if kind == "bpe" else sp_dir, {}, None)
    ids = tok.encode(TEXT + " 🙂🎉日本<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        dec = IncrementalDecoder(tok, skip_special_tokens=skip)
        pieces = [dec.push(ids[i:i + step]) for i in range(0, len(ids), step)]
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=skip)
        assert dec.flush() == ""
    # held-back bytes of an unfinished character come out of flush as U+FFFD, like decode
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push([i]) for i in ids[:cut]) + dec.flush() == tok.decode(ids[:cut])


def test_incremental_decoder_with_prompt(bpe_dir: Path, sp_dir: Path) -> None:
    for folder in (bpe_dir, sp_dir):
        tok = load_tokenizer(folder, {}, None)
        prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        gen = tok.encode("héllo 你好 🎉!", add_special_tokens=False)
        dec = IncrementalDecoder(tok, prompt)
        out = "".join(dec.push([i]) for i in gen) + dec.flush()
        full, head = tok.decode(prompt + gen), tok.decode(prompt)
        assert full.startswith(head) and out == full[len(head):]
        if folder == bpe_dir:
            assert out == tok.decode(gen)  # byte-level BPE: prompt context changes nothing
