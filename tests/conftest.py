import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run through Triton's interpreter where there is no GPU. triton.jit reads this
# when a kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS, VOCAB, save_reference  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import lucebox  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # real configs (no weights) shipped in the repo


@pytest.fixture(scope="session")
def reference_models(tmp_path_factory):
    """name -> (folder, float64 transformers model), built once per test session."""
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = (folder, save_reference(name, folder))
        return made[name]

    return get


ARCHITECTURES = sorted(BUILDERS)


@pytest.fixture
def model_copy(reference_models, tmp_path):
    """name -> a private copy of that reference model's folder, for a test to damage."""
    def copy(name: str):
        dest = tmp_path / name
        shutil.copytree(reference_models(name)[0], dest)
        return dest

    return copy


@pytest.fixture
def llama_copy(model_copy):
    return model_copy("llama")


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like during the test returns NaN (floats) or a huge value
    (integers), so an output element a kernel fails to write shows up."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_like(*a, **k)))


CORPUS = ["hello world, this is a tiny corpus.", "the quick brown fox jumps over the lazy dog!",
          "stop here? or go on and on, said the model."] * 20
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


@pytest.fixture(scope="session")
def text_model(reference_models, tmp_path_factory):
    """A tiny Mistral with a trained BPE tokenizer.json and a chat template."""
    folder, _ = reference_models("mistral")
    dest = tmp_path_factory.mktemp("with_tokenizer")
    shutil.copytree(folder, dest, dirs_exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                            "chat_template": TEMPLATE}))
    return lucebox.LLM(dest, device="cpu", dtype="float32")
