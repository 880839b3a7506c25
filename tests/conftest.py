import inspect
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# Triton kernels run through Triton's interpreter where there is no GPU. triton.jit reads this
# when a kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `python -m pytest` puts the checkout's root first on sys.path, where our top-level `kernels/`
# folder (installed as lucebox.kernels) would shadow the `kernels` distribution that transformers
# (>= 5.25) imports. lucebox itself comes from its install, so the root is not needed here.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
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


class _Float64Torch(types.ModuleType):
    """torch, except that float32 (and float) mean float64."""

    def __getattr__(self, name):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


def _in_float64(fn):
    """`fn` (its undecorated code) with `torch` bound to _Float64Torch in its globals."""
    fn = inspect.unwrap(fn)
    return types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch("torch")}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


# Each hybrid's transformers module, and its classes whose forward computes in float32 (besides
# the module's two delta-rule functions).
_FLOAT32_CLASSES = {
    "qwen3_next": ("Qwen3NextRMSNormGated", "Qwen3NextTopKRouter"),
    "qwen3_5": ("Qwen3_5RMSNormGated",),
    "qwen3_5_moe": ("Qwen3_5MoeRMSNormGated", "Qwen3_5MoeTopKRouter"),
}


@pytest.fixture
def exact_reference(monkeypatch):
    """transformers' hybrids (Qwen3-Next, Qwen3.5) compute their delta rule, gated norm and router
    in float32 whatever the model's dtype; run those same functions with float32 meaning float64, so
    a float64 comparison measures lucebox, not transformers' rounding."""
    import importlib

    for name, classes in _FLOAT32_CLASSES.items():
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        for function in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, function, _in_float64(getattr(module, function)))
        for cls in (getattr(module, c) for c in classes):
            monkeypatch.setattr(cls, "forward", _in_float64(cls.forward))


@pytest.fixture
def float64_kernels(monkeypatch):
    """lucebox's torch references compute norm statistics and routing in float32 whatever the
    model's dtype (as the reference implementations do); with float32 meaning float64 in their
    modules, a float64 model computes in float64 throughout (for finite differences)."""
    from lucebox.kernels import moe, norm

    for module in (moe, norm):
        monkeypatch.setattr(module, "torch", _Float64Torch("torch"))


def greedy_by_forwards(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy choice after each prefix, by whole forwards: on the hybrids (transformers
    5.24, CPU) its cached `generate` disagrees with its own forward, so the forward is the reference."""
    with torch.no_grad():
        for _ in range(n):
            ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids


def rewrite_weights(folder: Path, change) -> None:
    """`change(tensors)` applied to a folder's model.safetensors, in place."""
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def add_mtp_head(folder: Path, hidden: int) -> None:
    """The multi-token-prediction tensors a real Qwen3-Next / Qwen3.5 checkpoint ships beside the
    model (a few of them, at their real names and shapes)."""
    def add(tensors):
        tensors.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.ones(hidden),
                        "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
                        "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
                        "mtp.layers.0.input_layernorm.weight": torch.ones(hidden)})

    rewrite_weights(folder, add)


CORPUS = ["hello world, this is a tiny corpus.", "the quick brown fox jumps over the lazy dog!",
          "stop here? or go on and on, said the model."] * 20
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def with_tokenizer(folder: Path, dest: Path) -> Path:
    """A copy of a model folder with a BPE tokenizer.json trained on CORPUS (special tokens <unk>,
    <s>, </s>) and a chat template."""
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
    return dest


@pytest.fixture(scope="session")
def text_model(reference_models, tmp_path_factory):
    """A tiny Mistral with a trained BPE tokenizer.json and a chat template."""
    dest = with_tokenizer(reference_models("mistral")[0], tmp_path_factory.mktemp("with_tokenizer"))
    return lucebox.LLM(dest, device="cpu", dtype="float32")
