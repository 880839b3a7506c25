"""lucebox.checkpoints.gguf.tokenizer against the tokenizers a GGUF file was converted from.

Each original is trained here, turned into tokenizer.ggml.* metadata the way llama.cpp's
convert_hf_to_gguf.py does, written to a real .gguf with gguf.GGUFWriter and read back with
gguf.GGUFReader; the tokenizer rebuilt from that must encode and decode like the original.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import sentencepiece as spm
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from lucebox.checkpoints.gguf.tokenizer import tokenizer_from_gguf
from lucebox.errors import TokenizerError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
CORPUS = [
    "héllo wörld 你好 🙂 and 🎉",
    "The quick brown fox jumps over the lazy dog. I'M SURE YOU'LL see, it's fine, we've done it.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "numbers 1234567 and 3.14159, 2024-05-01, 1000000 and 42 or 123456789",
    "spaces   and    more     spaces\r\n\r\nline\n\n\nbreaks",
] * 20
TEXTS = [
    "héllo wörld 你好 🙂",
    "emoji 🎉🙂👍🏽 and a family 👨‍👩‍👧 日本",  # 日本 and most emoji are not in the corpus: byte pieces
    "def f(x):\n    return x ** 2  # square\n",
    "tabs\tand   spaces   \n\n\nnewlines\r\n end  ",
    "numbers 1234567 3.14159 and 2024-05-01",
    "I'M SURE YOU'LL see, it's fine",
    "<|im_start|>user\nhello 1234<|im_end|>\n<|im_start|>assistant\n",
    "a<tool>b <tool> c",
    "the quicker browner foxes jumped over lazier dogs, surely",  # words the vocab must build by merges
    "a qqqq b",  # " qqqq" is a vocab token no merge reaches: only Llama 3's ignore_merges finds it
    " leading space",
    "",
]
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "héllo 1234 🙂"}]

# The split regexes of real models' tokenizer.json, written out here independently of the module under test
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _read_back(path: Path, write) -> dict[str, object]:
    """Writes a GGUF file with `write(writer)` and returns its metadata as plain values, as a reader would."""
    writer = gguf.GGUFWriter(str(path), "llama")
    write(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}


@pytest.fixture(scope="module")
def trained_bpe() -> str:
    """A byte-level BPE (GPT-2 split) with control tokens, as tokenizer.json."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def _original(trained_bpe: str, split: str | None, ignore_merges: bool, add_bos: bool) -> HFTokenizer:
    """The trained BPE laid out as a GPT-2, Llama 3 or Qwen2 tokenizer.json, with one user-defined token."""
    data = json.loads(trained_bpe)
    data["model"]["ignore_merges"] = ignore_merges
    data["model"]["vocab"]["Ġqqqq"] = len(data["model"]["vocab"])
    tok = HFTokenizer.from_str(json.dumps(data))
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    if split is not None:  # the Llama 3 / Qwen2 layout: a regex Split, then bytes without the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    return tok


def _bpe_metadata(tok: HFTokenizer, pre: str, path: Path, **extra) -> dict[str, object]:
    """convert_hf_to_gguf.py's gpt2 vocab: id order, added tokens as CONTROL (special) or USER_DEFINED."""
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens = [added[i].content if i in added else by_id[i] for i in range(len(by_id))]
    types = [(CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL for i in range(len(by_id))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    eos = tok.token_to_id("<|im_end|>")

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tok.token_to_id("<|endoftext|>"))
        w.add_eos_token_id(eos)
        w.add_chat_template(CHATML)
        for key, value in extra.items():
            getattr(w, f"add_{key}")(value)

    return _read_back(path, write)


@pytest.mark.parametrize("pre,split,llama3", [("gpt-2", None, False), ("llama-bpe", LLAMA3_SPLIT, True),
                                              ("qwen2", QWEN2_SPLIT, False)])
def test_byte_level_bpe_from_gguf_encodes_and_decodes_like_the_original(
        trained_bpe: str, tmp_path: Path, pre: str, split: str | None, llama3: bool) -> None:
    # llama.cpp adds BOS by default for the Llama 3 family and ignores merges for words in the vocab
    original = _original(trained_bpe, split, ignore_merges=llama3, add_bos=llama3)
    tok = tokenizer_from_gguf(_bpe_metadata(original, pre, tmp_path / "m.gguf"), tmp_path / "m.gguf")
    assert tok is not None
    for text in TEXTS:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == original.encode(text, add_special_tokens=special).ids, (pre, text)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == original.decode(ids, skip_special_tokens=skip)
        assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    assert tok.bos_token_id == original.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == (original.token_to_id("<|im_end|>"),)
    assert tok.vocab_size == original.get_vocab_size()
    assert (tok.encode("hi")[0] == tok.bos_token_id) is llama3
    assert tok.decode(tok.encode("<|im_start|>x<tool>")) == "x<tool>"  # control skipped, user-defined kept
    assert tok.apply_chat_template(MESSAGES) == "<|endoftext|><|im_start|>user\nhéllo 1234 🙂<|im_end|>\n" \
                                                "<|im_start|>assistant\n"


def test_add_bos_and_add_eos_keys_override_the_defaults(trained_bpe: str, tmp_path: Path) -> None:
    original = _original(trained_bpe, LLAMA3_SPLIT, ignore_merges=True, add_bos=False)
    eot = original.token_to_id("<|endoftext|>")
    metadata = _bpe_metadata(original, "llama-bpe", tmp_path / "m.gguf", add_bos_token=False, add_eos_token=True,
                             eot_token_id=eot)
    tok = tokenizer_from_gguf(metadata, tmp_path / "m.gguf")
    eos = original.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == (eos, eot)  # llama.cpp ends generation on EOT as on EOS
    assert tok.encode("hello 1234") == [*original.encode("hello 1234").ids, eos]
    assert tok.encode("hello", add_special_tokens=False) == original.encode("hello").ids


def test_default_pre_tokenizer_splits_like_llama_cpp(trained_bpe: str, tmp_path: Path) -> None:
    # llama.cpp's "default": punctuation runs, then the GPT-2 regex, then digit runs, then digit triples,
    # each splitting what the one before left (expected pieces worked out by hand from llama-vocab.cpp)
    metadata = _bpe_metadata(_original(trained_bpe, None, False, False), "default", tmp_path / "m.gguf")
    tok = tokenizer_from_gguf(metadata, tmp_path / "m.gguf")
    pieces = [p for p, _ in tok._tk.pre_tokenizer.pre_tokenize_str("Hello, world !! 12345+x")]
    assert pieces == ["Hello", ",", "Ġworld", "Ġ", "!!", "Ġ", "123", "45", "+", "x"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("sp") / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(prefix), vocab_size=500, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, control_symbols=["<|im_start|>", "<|im_end|>"],
        user_defined_symbols=["<tool>"], minloglevel=2)
    return prefix.with_suffix(".model")


def _sp_metadata(sp: spm.SentencePieceProcessor, path: Path, **extra) -> dict[str, object]:
    """convert_hf_to_gguf.py's sentencepiece vocab: pieces, scores, types from the model, <tool> an added token."""
    n = sp.get_piece_size()
    types = [UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
             else BYTE if sp.is_byte(i) else NORMAL for i in range(n)]
    types[sp.piece_to_id("<tool>")] = USER_DEFINED

    def write(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_chat_template(CHATML)
        for key, value in extra.items():
            getattr(w, f"add_{key}")(value)

    return _read_back(path, write)


def _llama_cpp_spm(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenize: BOS, special tokens cut out, every text fragment encoded on its own
    with the dummy-prefix space (it follows a special token or the start)."""
    specials = ("<|im_start|>", "<|im_end|>", "<tool>")
    ids, rest = [sp.bos_id()], text
    while rest:
        at = min(((rest.find(s), s) for s in specials if s in rest), default=(len(rest), ""))
        ids += sp.encode(rest[:at[0]]) if at[0] else []
        ids += [sp.piece_to_id(at[1])] if at[1] else []
        rest = rest[at[0] + len(at[1]):]
    return ids


def test_sentencepiece_from_gguf_encodes_and_decodes_like_the_original(sp_model: Path, tmp_path: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = tokenizer_from_gguf(_sp_metadata(sp, tmp_path / "m.gguf"), tmp_path / "m.gguf")
    assert tok is not None and tok.bos_token_id == sp.bos_id() and tok.eos_token_ids == (sp.eos_id(),)
    assert tok.vocab_size == sp.get_piece_size()
    for text in TEXTS:
        assert tok.encode(text) == _llama_cpp_spm(sp, text), text
        if not any(s in text for s in ("<|im", "<tool>")):
            assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
            assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text)) == text
    assert tok.decode(tok.encode("<|im_start|>x<tool>")) == "x<tool>"
    assert tok.apply_chat_template(MESSAGES) == "<s><|im_start|>user\nhéllo 1234 🙂<|im_end|>\n<|im_start|>assistant\n"
    # add_bos_token / add_eos_token / add_space_prefix as the file says
    metadata = _sp_metadata(sp, tmp_path / "n.gguf", add_bos_token=False, add_eos_token=True, add_space_prefix=False)
    tok = tokenizer_from_gguf(metadata, tmp_path / "n.gguf")
    # without the dummy prefix, " hello" is what the prefixing original makes of "hello"
    assert tok.encode(" hello 1234") == [*sp.encode("hello 1234"), sp.eos_id()]
    assert tok.encode("hello") != sp.encode("hello")


def test_no_tokenizer_model_key_gives_none(tmp_path: Path) -> None:
    assert tokenizer_from_gguf({"general.architecture": "llama"}, tmp_path / "m.gguf") is None


@pytest.mark.parametrize("change,match", [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model is 'bert'"),
    ({"tokenizer.ggml.model": "rwkv"}, "tokenizer.ggml.model is 'rwkv'"),
    ({"tokenizer.ggml.pre": "mystery-bpe"}, "tokenizer.ggml.pre is 'mystery-bpe'"),
    ({"tokenizer.ggml.pre": None}, "has no tokenizer.ggml.pre"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries"),
    ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores has 1 entries"),
    ({"tokenizer.ggml.eos_token_id": 10**6}, "tokenizer.ggml.eos_token_id is 1000000"),
    ({"tokenizer.ggml.bos_token_id": -1}, "tokenizer.ggml.bos_token_id is -1"),
    ({"tokenizer.ggml.merges": ["h e", "no such"]}, "tokenizer.ggml.merges entry 1"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "tokenizer.ggml.add_bos_token is 'yes'"),
    ({"tokenizer.chat_template": 3}, "tokenizer.chat_template holds a int"),
])
def test_malformed_metadata_is_refused_naming_the_key(trained_bpe: str, tmp_path: Path, change: dict,
                                                       match: str) -> None:
    metadata = _bpe_metadata(_original(trained_bpe, None, False, False), "gpt-2", tmp_path / "m.gguf")
    metadata.update(change)
    metadata = {k: v for k, v in metadata.items() if v is not None}
    with pytest.raises(TokenizerError, match=match) as e:
        tokenizer_from_gguf(metadata, tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and "m.gguf" in str(e.value)


def test_repeated_token_and_broken_sentencepiece_are_refused(sp_model: Path, tmp_path: Path) -> None:
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    metadata = _sp_metadata(sp, tmp_path / "m.gguf")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens holds 'a' twice"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.tokens": [*tokens[:-1], "a"]}, tmp_path / "m.gguf")
    # a byte piece must be spelled <0xXX>
    bad_byte = [*tokens[:-1], "not-a-byte"]
    types = [*metadata["tokenizer.ggml.token_type"][:-1], BYTE]
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens does not make a valid SentencePiece"):
        tokenizer_from_gguf({**metadata, "tokenizer.ggml.tokens": bad_byte, "tokenizer.ggml.token_type": types},
                            tmp_path / "m.gguf")
    # without an unknown-typed token, the unknown id's token is sentencepiece's unknown piece (llama.cpp: id 0)
    no_unknown = [NORMAL if t == UNKNOWN else t for t in metadata["tokenizer.ggml.token_type"]]
    tok = tokenizer_from_gguf({**metadata, "tokenizer.ggml.token_type": no_unknown}, tmp_path / "m.gguf")
    assert tok.encode("héllo 日本") == [sp.bos_id(), *sp.encode("héllo 日本")]
