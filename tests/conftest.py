import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import BUILDERS, save_reference  # noqa: E402

SHARED_CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "configs"


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
