import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run through Triton's interpreter where there is no GPU. triton.jit reads this
# when a kernel module is imported, so it is set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS, save_reference  # noqa: E402

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
