"""`bench/gpu_check.sh --dry-run` runs every section of the GPU check on the CPU, with a carried Triton
cache folder, and writes one JSON; a section cut short by its time box leaves its partial log; a run
where nothing ran fails. And the carried cache is hit after it moves (bench/triton_cache.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "correctness", "graph_tests", "laguna_xs2", "kernel_table", "drafter", "step_profile")
# One cheap specialization for sm_90: enough to build, carry, relocate and hit a cache (compiles are slow here).
TINY_CACHE = ["--kernels", "_rms_norm_kernel", "--limit", "1", "--sm", "90"]


def run_script(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", **env}
    environment.pop("TRITON_INTERPRET", None)  # the script sets it for the dry run's sections
    return subprocess.run(["bash", "bench/gpu_check.sh", *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=900)


def run_python(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    environment.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def carried_cache(tmp_path_factory) -> Path:
    """A cache built in one folder, then moved (as the device tool carries it): the build folder is gone."""
    built = tmp_path_factory.mktemp("built") / "triton-cache"
    done = run_python("bench/triton_cache.py", "--out", str(built), *TINY_CACHE)
    assert done.returncode == 0, done.stderr[-2000:]
    carried = tmp_path_factory.mktemp("carried") / "triton-cache"
    shutil.copytree(built, carried)
    shutil.rmtree(built)
    return carried


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, carried_cache) -> tuple[Path, dict]:
    """(the output folder, the sections) of one dry run of the shell script, which every test here reads."""
    out = tmp_path_factory.mktemp("gpu-check")
    done = run_script(out, "--dry-run", TRITON_CACHE_DIR=str(carried_cache))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "gpu-check.json").read_text())["sections"]


def test_the_carried_cache_is_hit_after_it_moved(carried_cache):
    """Relocated, the moved cache answers Triton's own lookup for the same launch: nothing compiles."""
    manifest = json.loads((carried_cache / "triton-cache.json").read_text())
    assert manifest["compiled"] == manifest["entries"] == 1 and 0 < manifest["bytes"] < 64 << 20
    assert {"triton", "triton_key_sha256", "backend_hash", "env_vars"} <= set(manifest["fingerprint"])
    assert manifest["fingerprint"]["env_vars"] == {}  # as a GPU run leaves them: TRITON_DEFAULT_FP_FUSION unset
    probe = f"""
import json, sys, time
sys.path.insert(0, "tests"); sys.argv = ["x"]
from bench import triton_cache
triton_cache.relocate(triton_cache.Path({str(carried_cache)!r}))
from bench.triton_compile import compile_launch, record_launches
import os; os.environ.pop("TRITON_DEFAULT_FP_FUSION")  # set by triton_compile; a GPU run has it unset
os.environ["TRITON_CACHE_DIR"] = {str(carried_cache)!r}
from kernel_compile import exercise_engine
launch = triton_cache.select_launches(record_launches(exercise_engine), ["_rms_norm_kernel"], ["bf16"], 1)[0]
start = time.perf_counter()
kernel = compile_launch(launch, 90)
print(json.dumps({{"key": kernel.hash, "seconds": time.perf_counter() - start,
                  "check": triton_cache.check(triton_cache.Path({str(carried_cache)!r}))}}))
"""
    done = run_python("-c", probe)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["key"] in manifest["keys"] and got["check"]["usable"], got
    assert len(list(carried_cache.glob("*/__grp__*.json"))) == 1  # a miss would have added an entry
    group = json.loads(next(carried_cache.glob("*/__grp__*.json")).read_text())["child_paths"]
    assert all(path.startswith(str(carried_cache)) for path in group.values())
    assert {Path(p).suffix for p in group.values()} == {".cubin", ".json"}  # IR a hit never reads was dropped


def test_dry_run_records_every_section_with_the_carried_cache(dry_run):
    tmp_path, sections = dry_run
    assert list(sections) == list(SECTIONS)
    assert all(s["dry_run"] and s["seconds"] >= 0 and s["status"] in ("ok", "skipped") for s in sections.values())
    environment = sections["environment"]
    assert environment["torch"] and environment["gpu"] is None and environment["triton_cache"]["usable"]
    assert all(s["cache_misses"] == 0 for s in sections.values())  # the interpreter compiles nothing
    assert sections["graph_tests"]["status"] == "skipped" and "CUDA" in sections["graph_tests"]["reason"]
    correctness = sections["correctness"]
    assert correctness["cache"]["offloads"] and correctness["cache"]["kv_policy"] == "select"
    assert set(correctness["runs"]) == {"graphs-blocking0", "eager-blocking0", "speculative-blocking0",
                                        "graphs-blocking1"}
    assert all(correctness["identical_to_graphs"].values()) and correctness["status"] == "ok"
    assert correctness["runs"]["speculative-blocking0"]["rounds"] >= 1
    assert (tmp_path / "gpu-check-logs" / "correctness-blocking1.log").exists()
    xs2 = sections["laguna_xs2"]
    assert xs2["status"] == "ok" and xs2["load_s"] > 0 and xs2["first_request_s"] > 0
    assert [row["context"] for row in xs2["decode"]] == xs2["contexts"]
    assert all(row["decode_tokens_per_s"] > 0 and row["achieved_gb_per_s"] > 0 for row in xs2["decode"])
    table = sections["kernel_table"]
    assert [(r["call"], r["rows"]) for r in table["rows"]] == [("route", 1)]
    assert table["rows"][0]["measured_us"] > 0 and table["rows"][0]["predicted_us"] > 0
    drafter = sections["drafter"]
    assert drafter["identical"] and drafter["acceptance_length"] >= 1 and drafter["speculative_tokens_per_s"] > 0
    step = sections["step_profile"]
    assert step["status"] == "ok" and step["verify8_over_decode1"] > 0 and step["launches_per_token_xs2"] > 0
    assert {row["kernel"] for row in step["kernel_bandwidth"]} == {"linear", "moe_experts"}
    for name in SECTIONS:  # each section's output was streamed to its own log
        assert f'"{name}"' in (tmp_path / "gpu-check-logs" / f"{name}.txt").read_text()


def test_a_section_cut_short_keeps_its_partial_log_and_what_it_recorded(tmp_path):
    done = run_script(tmp_path, "--dry-run", SECTIONS="correctness", TIME_BOX="6", STALL_SECTION="correctness")
    assert done.returncode != 0 and "correctness: rc=124" in done.stdout, done.stdout + done.stderr[-2000:]
    sections = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]
    assert sections["correctness"]["status"] == "timed_out" and sections["correctness"]["dry_run"]
    log = (tmp_path / "gpu-check-logs" / "correctness.txt").read_text()
    assert '"status": "started"' in log  # written while it ran, not when it returned


def test_a_child_past_its_timeout_is_killed_and_leaves_what_it_printed(tmp_path, monkeypatch):
    """Each test a section runs (Check.python) streams into its own log and has its own time-out."""
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.gpu_check import Check

    check = Check(tmp_path, dry=True)
    ran = check.python(["-c", "import time; print('halfway', flush=True); time.sleep(60)"], "slow.log", timeout=3)
    assert ran.timed_out and ran.returncode is None
    assert "halfway" in (tmp_path / "gpu-check-logs" / "slow.log").read_text()
    quick = check.python(["-c", "print('done')"], "quick.log", timeout=30)
    assert quick.returncode == 0 and not quick.timed_out and quick.output.strip() == "done"


def test_a_run_where_nothing_ran_fails(tmp_path):
    missing = run_script(tmp_path, "--dry-run", PYTHON=str(tmp_path / "no-python"))
    assert missing.returncode != 0 and "no section ran" in missing.stderr
    unknown = run_script(tmp_path, "--dry-run", SECTIONS="no_such_section")
    assert unknown.returncode != 0 and "no section ran" in unknown.stderr


def test_the_shell_script_runs_the_sections_in_the_table_order():
    listed = run_python("bench/gpu_check.py", "--list").stdout.split()
    assert listed[0::2] == list(SECTIONS)
    assert sum(int(seconds) for seconds in listed[1::2]) <= 8 * 60 - 20  # under 8 minutes with the install
    assert listed[:4] == ["environment", "20", "correctness", "70"]  # the correctness subset comes first
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "PY=${PYTHON:-python3}" in script and " python " not in script


def test_the_graphed_step_at_the_xs2_pattern_launches_at_most_12_kernels_per_layer(dry_run):
    """Kernels per decoded token of the graphed step at Laguna XS.2's layer pattern (every ATen kernel and
    Triton launch of the step body, views excluded; bench/kernel_count.py, which the step profile runs):
    each launch is a dependent node of the CUDA graph, ~2 us on a consumer GPU, so launches per layer
    decide whether a step can reach the bandwidth roofline (issue 25: at most 12 a layer, 500 a token;
    ~1,800 before)."""
    step = dry_run[1]["step_profile"]
    assert set(step["launches_per_layer"]) == {"full+dense", "sliding+moe", "full+moe"}
    assert step["xs2_layers_per_kind"] == {"full+dense": 1, "sliding+moe": 30, "full+moe": 9}
    assert step["most_per_layer"] <= 12, step["ops_per_kind"]
    assert step["launches_per_token_xs2"] <= 500
    assert sum(step["head"].values()) <= 2, step["head"]  # LM head + greedy choice


def test_the_correctness_runs_pool_offloads(tmp_path):
    """The correctness section's cache settings under its prompt send chunks of the full layer's pool
    to the host (the stream race it checks needs the copy stream to run)."""
    probe = """
import json, sys, torch
sys.path.insert(0, ".")
import lucebox
from bench.gpu_check import OFFLOADING, PROMPT_TOKENS
from bench.kernels import dry_run_model
llm = lucebox.LLM(str(dry_run_model()), device="cpu", dtype="float32", load_format="dummy", quantization="int4",
                  **OFFLOADING)
cache = llm.engine.new_cache()
for _ in llm.engine.prefill([3 + i % 400 for i in range(PROMPT_TOKENS)], cache):
    pass
cache.commit(PROMPT_TOKENS)
print(json.dumps([len(layer.residency.non_resident()) for layer in cache.layers if hasattr(layer, "residency")]))
"""
    done = run_python("-c", probe, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-2000:]
    on_host = json.loads(done.stdout.strip().splitlines()[-1])
    assert on_host and all(chunks > 0 for chunks in on_host), on_host
