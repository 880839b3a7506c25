"""`bench/roofline_kernels.py`: the per-kernel prediction's arithmetic on a hand-computed spec, how a
call's bytes split over its launches, and the committed table (bench/results/roofline-kernels.json):
every decode call of Laguna XS.2 at 1, 4 and 16 rows, predicted on each card, with sane numbers."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SYS_PATH = list(sys.path)
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import roofline  # noqa: E402
import roofline_kernels as rk  # noqa: E402

sys.path[:] = _SYS_PATH  # the root left on it would shadow transformers' `kernels` with ours

TABLE = ROOT / "bench" / "results" / "roofline-kernels.json"
CALLS = {"qkv_full", "qkv_sliding", "o_full", "o_sliding", "dense_gate_up", "dense_down", "moe_experts", "route",
         "attention_full", "attention_sliding"}
CARDS = {"rtx3090", "rtx4090", "h100", "h200"}
# 1 GB/s, 4 SMs x 4 schedulers x 1 MHz: 16 warp instructions a microsecond when every SM issues.
SLOW = roofline.Hardware(bandwidth=1e9, sms=4, clock_hz=1e6, schedulers_per_sm=4, memory_bytes=1 << 40,
                         source="test", warps_per_sm=16, shared_per_sm=64 * 1024)


def spec(**fields) -> dict:
    return {"num_warps": 4, "registers": 64, "shared_bytes": 0, "instructions_per_byte": None, **fields}


def test_occupancy_takes_the_tightest_of_warps_registers_and_shared_memory():
    assert rk.occupancy(spec(), SLOW) == 4  # 16 warp slots / 4 warps (registers allow 65536 / 8192 = 8)
    assert rk.occupancy(spec(registers=255), SLOW) == 2  # 65536 // (255 x 32 x 4)
    assert rk.occupancy(spec(shared_bytes=40 * 1024), SLOW) == 1
    assert rk.occupancy(spec(registers=255, num_warps=16), SLOW) == 1  # never less than one


def test_a_small_grid_leaves_sms_idle_and_waits_for_bandwidth():
    # 2 programs on 4 SMs: half the bandwidth; 1e6 bytes / 0.5e9 B/s = 2 ms, plus the launch gap.
    got = rk.predict_launch(spec(), (2,), 1e6, SLOW, launch_seconds=1e-5)
    assert got["active_sms"] == 2 and got["waves"] == 1 and got["programs_per_sm"] == 0.5
    assert got["bandwidth_s"] == pytest.approx(2e-3) and got["issue_s"] == 0 and got["bound"] == "bandwidth"
    assert got["seconds"] == pytest.approx(2e-3 + 1e-5)


def test_instructions_per_byte_make_a_launch_issue_bound():
    # 64 programs, 4 a SM at once: 4 waves; each SM keeps 4 blocks x 4 warps, so all 4 schedulers issue.
    # 1e6 bytes x 0.5 instructions a byte / (4 SMs x 4 x 1 MHz) = 31.25 ms against 1 ms of traffic.
    got = rk.predict_launch(spec(instructions_per_byte=0.5), (8, 8), 1e6, SLOW, launch_seconds=0.0)
    assert got["programs"] == 64 and got["waves"] == 4 and got["instructions"] == pytest.approx(5e5)
    assert got["issue_s"] == pytest.approx(5e5 / 16e6) and got["bound"] == "instructions"
    # One warp per program on one SM: one scheduler of four issues.
    single = rk.predict_launch(spec(instructions_per_byte=0.5, num_warps=1), (1,), 1e6, SLOW, launch_seconds=0.0)
    assert single["issue_s"] == pytest.approx(5e5 / 1e6)


def test_a_calls_bytes_split_over_its_launches():
    class Launch:
        def __init__(self, kernel):
            self.kernel = kernel

    up, down, merge = Launch("_up_decode_kernel"), Launch("_down_decode_kernel"), Launch("_merge_kernel")
    moe = rk.Call("moe_experts", 1, None, 39, 900, None, split={"up": 2 / 3, "down": 1 / 3})
    assert [rk._share(moe, launch, [up, down]) for launch in (up, down)] == [2 / 3, 1 / 3]
    attention = rk.Call("attention_full", 1, 1024, 10, 900, None)
    assert rk._share(attention, up, [up]) == 1.0 and rk._share(attention, merge, [up]) == 0.0


def test_expected_experts_under_uniform_routing():
    assert rk.expected_experts(1, 8, 256) == pytest.approx(8)
    assert rk.expected_experts(16, 8, 256) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 16))  # ~101, not 128
    assert rk.expected_experts(1000, 8, 256) == pytest.approx(256, rel=1e-6)


@pytest.fixture(scope="module")
def table() -> dict:
    return json.loads(TABLE.read_text())


def test_the_committed_table_predicts_every_decode_kernel_on_every_card(table):
    rows = table["kernels"]
    assert "none" in table["gpu_measurements"] and table["command"].startswith("python3 bench/roofline_kernels.py")
    assert {(r["call"], r["rows"]) for r in rows} == {(c, n) for c in CALLS for n in (1, 4, 16)}
    attention = {(r["call"], r["rows"], r["context"]) for r in rows if r["call"].startswith("attention")}
    assert attention == {(c, n, ctx) for c in ("attention_full", "attention_sliding") for n in (1, 4, 16)
                         for ctx in (1024, 32768, 131072)}
    for r in rows:
        assert "error" not in r, r
        assert set(r["predicted"]) == CARDS and r["registers"] > 0 and math.prod(r["grid"]) >= 1
        for p in r["predicted"].values():
            assert p["seconds"] >= table["assumed"]["launch_seconds"] and p["waves"] >= 1
    assert {r["kernel"] for r in rows if r["call"] == "moe_experts"} >= {"_up_decode_kernel", "_down_decode_kernel"}


def test_the_committed_tables_bytes_follow_the_model(table):
    rows = table["kernels"]

    def call_bytes(call, n, context=None):
        return sum(r["bytes"] for r in rows if (r["call"], r["rows"], r["context"]) == (call, n, context))

    n, k = (48 + 2 * 8) * 128 + 48, 2048  # fused q, k, v and the per-head gate of a full layer
    # int4 codes, a float16 scale per 128 inputs, bf16 x in and y out.
    assert call_bytes("qkv_full", 1) == n * k // 2 + n * (k // 128) * 2 + (n + k) * 2
    assert call_bytes("route", 1) >= 256 * 2048 * 4  # the float32 router
    # A full layer reads its context up to the pool, then the select pool (the engine's size) at 32K and 128K.
    pool = roofline.full_layer_kv_tokens(131072)
    kv_row = 2 * 8 * 128 * 2
    assert call_bytes("attention_full", 1, 131072) == call_bytes("attention_full", 1, 32768)
    assert call_bytes("attention_full", 1, 131072) >= pool * kv_row > call_bytes("attention_full", 1, 1024)
    # 16 rows choose ~101 distinct experts: more bytes than one row's 8, far fewer than 16 x 8.
    assert 8 < call_bytes("moe_experts", 16) / call_bytes("moe_experts", 1) * 8 < 128
    totals = {(t["hardware"], t["rows"], t["context"]): t["triton_kernels_s_per_step"] for t in table["token_totals"]}
    assert totals[("h100", 1, 1024)] < totals[("rtx3090", 1, 1024)]
