import sys
from pathlib import Path

import pytest

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
