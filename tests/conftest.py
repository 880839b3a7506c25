import inspect
import json
import os
import re
import shutil
import sys
import textwrap
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


def _without_the_root() -> None:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


_without_the_root()
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS, VARIANTS, VOCAB, save_reference  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

import lucebox  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"  # real configs (no weights) shipped in the repo


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread than on two contending with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def laguna(reference_models):
    """The tiny random Laguna checkpoint the speculation, drafter and training tests share."""
    return reference_models("laguna")[0]


ARCHITECTURES = sorted(set(BUILDERS) - VARIANTS)


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


def _torch_function(fn):
    """The plain function under transformers' kernel decorators: with the `kernels` distribution
    installed (transformers >= 5.25 depends on it) a kernelized function is an nn.Module whose
    forward calls the decorated function, which wraps the torch reference."""
    if isinstance(fn, torch.nn.Module):
        fn = inspect.getclosurevars(type(fn).forward).nonlocals["func"]
    return inspect.unwrap(fn)


def _in_float64(fn):
    """`fn` (its undecorated code) with `torch` bound to _Float64Torch in its globals."""
    fn = _torch_function(fn)
    return types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch("torch")}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _recompiled_in_float64(fn):
    """`fn` compiled again from its source with float32 meaning float64, tensor `.float()` casts
    (which `_in_float64` cannot reach) included."""
    fn = _torch_function(fn)
    source = textwrap.dedent(inspect.getsource(fn))
    source = source[re.search(r"^def ", source, re.MULTILINE).start():].replace(".float()", ".double()")
    namespace = {**fn.__globals__, "torch": _Float64Torch("torch")}
    exec(compile(source, inspect.getsourcefile(fn), "exec"), namespace)
    return namespace[fn.__name__]


# Each hybrid's transformers module: its delta-rule functions, and its classes whose forward
# computes in float32.
_GDN_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_FLOAT32_PARTS = {
    "qwen3_next": (_GDN_RULES, ("Qwen3NextRMSNormGated", "Qwen3NextTopKRouter")),
    "qwen3_5": (_GDN_RULES, ("Qwen3_5RMSNormGated",)),
    "qwen3_5_moe": (_GDN_RULES, ("Qwen3_5MoeRMSNormGated", "Qwen3_5MoeTopKRouter")),
    # KDA's rule, its decay (forget gate), gated norm and router, and the layer that calls the rule
    # (it casts the kept state); these also cast with `.float()`, so they are recompiled.
    "kimi_linear": (("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"),
                    ("KimiLinearForgetGate", "KimiLinearRMSNormGated", "KimiLinearTopkRouter",
                     "KimiLinearDeltaAttention")),
}


@pytest.fixture
def exact_reference(monkeypatch):
    """transformers' hybrids (Qwen3-Next, Qwen3.5, Kimi Linear) compute their delta rule, gated
    norm and router in float32 whatever the model's dtype; run those same functions with float32
    meaning float64, so a float64 comparison measures lucebox, not transformers' rounding."""
    import importlib

    for name, (functions, classes) in _FLOAT32_PARTS.items():
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        in_float64 = _recompiled_in_float64 if name == "kimi_linear" else _in_float64
        for function in functions:  # before the classes: their forwards' globals are copied with these in
            monkeypatch.setattr(module, function, in_float64(getattr(module, function)))
        for cls in (getattr(module, c) for c in classes):
            monkeypatch.setattr(cls, "forward", in_float64(cls.forward))


def logits_gap(llm, reference, ids: list[int]) -> float:
    """The largest difference between lucebox's logits over `ids` and the reference model's."""
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return (llm.logits(ids) - expected).abs().max().item()


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


def add_mtp_head(folder: Path, seed: int = 0, declare: bool = True) -> None:
    """A whole multi-token-prediction head, at the names and shapes a real Qwen3-Next / Qwen3.5
    checkpoint ships it beside the model: random fc and (1 + w) norms, and the model's last
    full-attention layer copied as mtp.layers.0 (so a test's reference can run it as that layer).
    `declare`: config.json says so (mtp_num_hidden_layers: 1, in text_config when there is one)."""
    g = torch.Generator().manual_seed(seed)

    def add(tensors):
        layers = [m for n in tensors if (m := re.match(r"(model\.(?:language_model\.)?layers\.(\d+)\.)self_attn\.", n))]
        layer = max(layers, key=lambda m: int(m[2]))[1]  # the last full-attention layer's prefix
        norm_weight = tensors[layer + "input_layernorm.weight"]
        hidden, dtype = norm_weight.shape[0], norm_weight.dtype
        tensors.update({"mtp.layers.0." + n[len(layer):]: t.clone() for n, t in list(tensors.items())
                        if n.startswith(layer)})
        norm = lambda: (torch.randn(hidden, generator=g) * 0.1).to(dtype)  # noqa: E731 - stored around 0
        tensors.update({"mtp.fc.weight": (torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5).to(dtype),
                        "mtp.norm.weight": norm(), "mtp.pre_fc_norm_embedding.weight": norm(),
                        "mtp.pre_fc_norm_hidden.weight": norm()})

    rewrite_weights(folder, add)
    if declare:
        config = json.loads((folder / "config.json").read_text())
        (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(config))


def add_nextn_layer(folder: Path, seed: int = 0) -> None:
    """A DeepSeek-V3-style multi-token-prediction layer, at the names GLM-4.5's checkpoints ship it:
    the model's last layer copied as model.layers.{n} (n its layer count), beside it a random eh_proj
    and plain norms (enorm, hnorm, shared_head.norm), and copies of the embedding and the LM head
    (embed_tokens, shared_head.head); config.json declares it (num_nextn_predict_layers: 1)."""
    g = torch.Generator().manual_seed(seed)
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]

    def add(tensors):
        last, head = f"model.layers.{n - 1}.", f"model.layers.{n}."
        norm_weight = tensors[last + "input_layernorm.weight"]
        hidden, dtype = norm_weight.shape[0], norm_weight.dtype
        tensors.update({head + name[len(last):]: t.clone() for name, t in list(tensors.items())
                        if name.startswith(last)})
        norm = lambda: (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)  # noqa: E731 - plain norms, around 1
        tensors.update({head + "eh_proj.weight": (torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5)
                        .to(dtype), head + "enorm.weight": norm(), head + "hnorm.weight": norm(),
                        head + "shared_head.norm.weight": norm(),
                        head + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                        head + "shared_head.head.weight": tensors["lm_head.weight"].clone()})

    rewrite_weights(folder, add)
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


CORPUS = ["hello world, this is a tiny corpus.", "the quick brown fox jumps over the lazy dog!",
          "stop here? or go on and on, said the model."] * 20
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def with_tokenizer(folder: Path, dest: Path, template: str = TEMPLATE) -> Path:
    """A copy of the model in `folder` at `dest`, with a BPE tokenizer.json trained on CORPUS and
    `template` as its chat template."""
    shutil.copytree(folder, dest, dirs_exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                            "chat_template": template}))
    return dest


@pytest.fixture(scope="session")
def mtp_folder(reference_models, tmp_path_factory):
    """name -> a copy of that reference model with an MTP head (config.json declares it): Qwen's
    mtp.* (`add_mtp_head`), or GLM-4.5's layer after the model's (`add_nextn_layer`)."""
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"{name}-mtp") / name
            shutil.copytree(reference_models(name)[0], folder)
            (add_nextn_layer if name == "glm4_moe" else add_mtp_head)(folder)
            made[name] = folder
        return made[name]

    return get


@pytest.fixture(scope="session")
def text_model(reference_models, tmp_path_factory):
    """A tiny Mistral with a trained BPE tokenizer.json and a chat template."""
    folder, _ = reference_models("mistral")
    return lucebox.LLM(with_tokenizer(folder, tmp_path_factory.mktemp("with_tokenizer")), device="cpu",
                       dtype="float32")


@pytest.fixture(scope="session")
def builtin_llm():
    """The built-in model (`lucebox.builtin`) with its DFlash drafter, opened once per session."""
    return lucebox.LLM()


@pytest.fixture(scope="session")
def tree_llm():
    """The built-in model and its DFlash drafter drafting trees every round, in float32 (for 1e-5)."""
    return lucebox.LLM(dtype="float32", adaptive=False)


@pytest.fixture(scope="session")
def chain_llm():
    """The same drafter drafting chains every round."""
    return lucebox.LLM(dtype="float32", adaptive=False, tree_budget=0)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A tiny Qwen3 with a chat template that writes Hermes tool calls (tests/tool_models.py)."""
    from tool_models import qwen_tools_model

    return qwen_tools_model(tmp_path_factory.mktemp("qwen_tools") / "model")


@pytest.fixture(scope="module")
def tools_server(tools_model):
    from lucebox.server.process import ServerProcess

    s = ServerProcess(str(tools_model), "--served-model-name", "m")
    yield s
    assert s.stop() == 0


@pytest.fixture(autouse=True)
def _root_kept_off_sys_path():
    """A test module that put the root on sys.path to import a bench script (at collection, or in a
    test) would let `kernels/` shadow transformers' `kernels` for every test after it."""
    _without_the_root()
    yield
