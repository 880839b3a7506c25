"""End to end: the built-in model (Laguna, a SentencePiece tokenizer) written as a GGUF file the
way llama.cpp's converter writes one, with its tokenizer in `tokenizer.ggml.*`, loads as the same
model and tokenizer: the same ids, the same logits, the same text."""

from __future__ import annotations

import sentencepiece as spm
import torch
from gguf_models import write_gguf

import lucebox
from lucebox.builtin import builtin_model

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
TEXT = "def mean(xs):\n    return sum(xs) / len(xs)\n\n\nclass Point:\n    def __init__(self, x, y):\n"


def _tokenizer_metadata(sp: spm.SentencePieceProcessor):
    def write(w) -> None:  # what convert_hf_to_gguf.py writes for a LlamaTokenizer with tokenizer.model
        n = sp.get_piece_size()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([sp.id_to_piece(i) for i in range(n)])
        w.add_token_scores([sp.get_score(i) for i in range(n)])
        w.add_token_types([UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i)
                           else BYTE if sp.is_byte(i) else NORMAL for i in range(n)])
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_add_bos_token(True)  # tokenizer_config.json's add_bos_token
        w.add_add_eos_token(False)
        w.add_add_space_prefix(False)  # the model was trained without a dummy prefix (its normalizer spec)

    return write


def test_the_builtin_model_as_a_gguf_file_reads_and_writes_the_same(tmp_path):
    import transformers

    folder = builtin_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    path = tmp_path / "laguna-code-6m-F32.gguf"
    write_gguf(model, "laguna", "F32", path, more_metadata=_tokenizer_metadata(sp))
    from_gguf = lucebox.LLM(path, device="cpu", dtype="float32")
    original = lucebox.LLM(folder, device="cpu", dtype="float32")
    ids = original.tokenizer.encode(TEXT)
    assert from_gguf.tokenizer.encode(TEXT) == ids
    assert from_gguf.tokenizer.decode(ids) == original.tokenizer.decode(ids)
    torch.testing.assert_close(from_gguf.logits(ids), original.logits(ids), rtol=0, atol=0)
    options = dict(max_tokens=24, temperature=0.0)
    assert from_gguf.generate(TEXT, **options).text == original.generate(TEXT, **options).text
