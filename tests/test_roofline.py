"""`bench/roofline.py`: its arithmetic on hand-computed cases, the bytes Laguna XS.2 reads per token, and
its command line writing the JSON the lead commits."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from lucebox.limits import KV_POOL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_roofline", ROOT / "bench" / "roofline.py")
roofline = sys.modules["bench_roofline"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(roofline)

# 1 GB/s and 2 SMs x 4 schedulers x 125 kHz = a warp instruction a microsecond: numbers to compute by hand.
SLOW = roofline.Hardware(bandwidth=1e9, sms=2, clock_hz=125e3, schedulers_per_sm=4, memory_bytes=1 << 40,
                         source="test")


def specs_with(experts_per_byte: float) -> dict:
    return {"summary": {"experts": {"4": {"bf16": {"instructions_per_byte": experts_per_byte}}}}}


def test_bandwidth_bound_time_is_bytes_over_bandwidth_plus_launches():
    kinds = {"experts": {"bits": 4, "bytes": 2_000_000}, "vendor_gemv": {"bits": 16, "bytes": 1_000_000}}
    # 2e6 bytes x 1e-4 instructions a byte / 1e6 a second = 0.2 ms of issue, under 3 ms of traffic.
    got = roofline.predict(SLOW, kinds, specs_with(1e-4), kernels_per_token=10, launch_seconds=1e-5)
    assert got["bandwidth_s"] == pytest.approx(3e-3)
    assert got["instruction_s"] == pytest.approx(2e-4)
    assert got["seconds_per_token"] == pytest.approx(3e-3 + 1e-4)
    assert got["tokens_per_s"] == pytest.approx(1 / 3.1e-3) and got["bound"] == "bandwidth"
    assert got["instructions_per_byte"] == {"experts": 1e-4, "vendor_gemv": None}


def test_instruction_bound_time_uses_the_specs_figure_and_launches_can_dominate():
    kinds = {"experts": {"bits": 4, "bytes": 1_000_000}}
    got = roofline.predict(SLOW, kinds, specs_with(0.01), kernels_per_token=500, launch_seconds=1e-4)
    # 1e6 bytes x 0.01 / 1e6 a second = 10 ms of issue against 1 ms of traffic; 500 x 0.1 ms of launches.
    assert got["bound"] == "instructions" and got["instruction_s"] == pytest.approx(1e-2)
    assert got["launch_s"] == pytest.approx(5e-2) and got["seconds_per_token"] == pytest.approx(6e-2)
    assert got["tokens_per_s_without_launches"] == pytest.approx(100)
    no_specs = roofline.predict(SLOW, kinds, None, kernels_per_token=0, launch_seconds=1e-4)
    assert no_specs["instruction_s"] == 0 and no_specs["seconds_per_token"] == pytest.approx(1e-3)


def test_laguna_bytes_per_token_match_a_hand_count():
    from lucebox.models import build_model_config

    cfg = build_model_config(json.loads((ROOT / "examples/laguna-xs2/config.json").read_text()))
    kinds = roofline.bytes_per_token(cfg, "int4", 1024)
    # int4 expert: codes (half a byte a weight) + a float16 scale per 128 inputs.
    gate_up = 1024 * 2048 // 2 + 1024 * (2048 // 128) * 2
    down = 2048 * 512 // 2 + 2048 * (512 // 128) * 2
    assert kinds["experts"]["bytes"] == 39 * (8 + 1) * (gate_up + down)  # 8 routed + the shared, 39 MoE layers
    row = 2 * 8 * 128 * 2  # bf16 K and V of 8 heads of 128
    assert kinds["kv"]["bytes"] == (30 * 512 + 10 * 1024) * row
    # Past the pool, a full layer's attention loads the whole select pool the engine sizes (8,192 tokens).
    pool = roofline.full_layer_kv_tokens(131072)
    assert pool == KV_POOL_TOKENS == roofline.full_layer_kv_tokens(32768)
    assert roofline.full_layer_kv_tokens(1024) == 1024
    assert roofline.bytes_per_token(cfg, "int4", 131072)["kv"]["bytes"] == (30 * 512 + 10 * pool) * row
    assert roofline.bytes_per_token(cfg, "int4", 131072, kvflash_tokens=4096)["kv"]["bytes"] == (
        (30 * 512 + 10 * 4096) * row)
    # The bf16 output head, and the routers in float32 (their stored dtype, kernels/moe.py routing_dtype).
    assert kinds["vendor_gemv"]["bytes"] == 100352 * 2048 * 2 + 39 * 256 * 2048 * 4


def test_cli_writes_every_prediction_with_its_inputs(tmp_path):
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({"commit": "abc", **specs_with(1.0)}))
    out = tmp_path / "roofline.json"
    assert roofline.main(["--specs", str(specs), "--kernels-per-token", "500", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["assumed"]["kernels_per_token"] == 500 and record["measured"]["specs_commit"] == "abc"
    assert "none" in record["gpu_measurements"]
    rows = record["predictions"]
    assert {(r["hardware"], r["weights"], r["context"]) for r in rows} == {
        (hw, fmt, ctx) for hw in ("rtx3090", "rtx4090", "h100", "h200") for fmt in ("int4", "bf16")
        for ctx in (1024, 32768, 131072)}
    assert not any(r["fits"] for r in rows if r["hardware"] in ("rtx3090", "rtx4090") and r["weights"] == "bf16")
    int4 = [r for r in rows if r["weights"] == "int4"]
    assert all(r["fits"] and r["instructions_per_byte"]["experts"] == 1.0 and r["tokens_per_s"] > 0 for r in int4)
