"""`bench/peers.py` at toy sizes: the built-in model written as a GGUF file, run by lucebox and
transformers (and llama.cpp where llama-cpp-python is installed: never a test dependency), with
speeds, ratios, KL divergences and the matching tokens recorded."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_peers_bench_writes_every_engine_s_columns(tmp_path):
    args = ["--models", "builtin", "--qtypes", "F32", "--prompt", "24", "--tokens", "4", "--runs", "2",
            "--kl-tokens", "8", "--threads", "1", "--name", "peers_toy", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "bench/peers.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "peers_toy-cpu.json").read_text())
    assert result["commit"] and result["command"] and result["versions"]["torch"]
    engines = result["results"]["builtin F32"]
    expected = {"lucebox", "transformers"} | ({"llama.cpp"} if importlib.util.find_spec("llama_cpp") else set())
    assert set(engines) == expected
    assert result["setup"]["prompt_tokens"] == 24 and result["setup"]["llama_cpp"] == ("llama.cpp" in expected)
    for name, row in engines.items():
        assert len(row["decode_runs"]) == 2 and row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
        ratio = row["decode_tokens_per_s"] / engines["lucebox"]["decode_tokens_per_s"]  # of rounded medians
        assert abs(row["decode_over_lucebox"] - ratio) < 0.01 * ratio + 1e-3, name
    # transformers holds exactly the weights the F32 file decodes to: the same distribution, tokens
    assert engines["lucebox"]["kl_from_lucebox_nats"] == 0.0
    assert 0 <= engines["transformers"]["kl_from_lucebox_nats"] < 1e-6
    assert engines["transformers"]["same_tokens_as_lucebox"] == 4
