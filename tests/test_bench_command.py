"""`lucebox bench`: one row per depth, every figure positive and finite, the same rows in JSON, CSV,
Markdown and a PNG; `--compare`; bad flags give one line and exit code 2. Speed is never asserted."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex
import sys

import pytest

from lucebox.benchmark import record, report, runner
from lucebox.benchmark.command import equivalent_command, parse_depths
from lucebox.cli import build_parser, main
from lucebox.engine import setup
from lucebox.engine.config import EngineConfig
from lucebox.errors import ContextLengthError, InvalidArgumentError

TINY = ["--depths", "256,512", "--gen", "8", "--repeat", "2", "--device", "cpu"]
SPEEDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "spec_decode_tokens_per_s")


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """The built-in model with its drafter at two depths, every output written once for the module."""
    out = tmp_path_factory.mktemp("bench")
    files = {kind: out / f"r.{kind}" for kind in ("json", "csv", "md", "png")}
    code = main(["bench", *TINY, "--json", str(files["json"]), "--csv", str(files["csv"]), "--md", str(files["md"]),
                 "--plot", str(files["png"])])
    assert code == 0
    return files, json.loads(files["json"].read_text())


def test_bench_json_has_one_row_per_depth_and_every_figure_positive_and_finite(bench_run):
    _, result = bench_run
    for key in ("schema", "date", "commit", "lucebox", "command", "machine", "model", "settings", "memory", "rows"):
        assert key in result, key
    assert result["schema"] == "lucebox-bench/1"
    assert result["command"].startswith("lucebox bench --device cpu --depths 256,512 --gen 8 --repeat 2 --json ")
    assert result["machine"]["cpu_count"] >= 1 and result["commit"]
    assert result["model"]["name"] == "laguna-code-6m (built-in)"
    assert result["settings"]["drafter"].endswith("dflash")  # draft=auto found the built-in drafter
    assert result["memory"]["peak_memory"] == "process_peak_rss"
    assert [row["depth"] for row in result["rows"]] == [256, 512]
    for row in result["rows"]:
        assert set(row) == set(report.ROW_KEYS)
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
            assert value > 0 or key in ("kv_host_bytes", "drafts_per_round"), (key, value)  # 0: no offload / no drafts
        for speed in SPEEDS:
            assert row[f"{speed}_min"] <= row[speed] <= row[f"{speed}_max"]
        assert row["acceptance_length"] >= 1.0
        low, high = (row["spec_decode_tokens_per_s_min"] / row["decode_tokens_per_s_max"],
                     row["spec_decode_tokens_per_s_max"] / row["decode_tokens_per_s_min"])
        assert low <= row["spec_speedup"] <= high  # the median of paired ratios
    assert report.problems(result) == []


def test_csv_markdown_and_png_hold_the_same_rows(bench_run):
    files, result = bench_run
    with files["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["depth"]) for r in rows] == [row["depth"] for row in result["rows"]]
    for got, row in zip(rows, result["rows"], strict=True):
        assert got["model"] == result["model"]["name"] and got["device"] == "cpu"
        assert all(float(got[k]) == pytest.approx(row[k]) for k in report.ROW_KEYS)
    lines = files["md"].read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| depth |"))
    assert re.fullmatch(r"\|(---:?\|)+", lines[header + 1])
    assert [line.split("|")[1].strip() for line in lines[header + 2:]] == ["256", "512"]
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schema_check_names_a_nan_a_zero_and_a_missing_figure(bench_run):
    _, result = bench_run
    broken = json.loads(json.dumps(result))
    broken["rows"][0]["decode_tokens_per_s"] = float("nan")
    broken["rows"][1]["prefill_tokens_per_s"] = 0.0
    del broken["rows"][1]["kv_device_bytes"]
    found = report.problems(broken)
    assert any("depth 256: decode_tokens_per_s is nan" in p for p in found)
    assert any("depth 512: prefill_tokens_per_s is 0.0, not positive" in p for p in found)
    assert any("depth 512: kv_device_bytes is 'absent'" in p for p in found)
    assert report.problems({"rows": []}) == ['no "schema": "lucebox-bench/1"']


def test_plain_only_run_has_null_speculative_figures_and_compare_prints_ratios(bench_run, tmp_path, capsys):
    files, _ = bench_run
    plain = tmp_path / "plain.json"
    assert main(["bench", "--depths", "256", "--gen", "4", "--repeat", "1", "--draft", "none", "--device", "cpu",
                 "--json", str(plain)]) == 0
    result = json.loads(plain.read_text())
    assert report.problems(result) == []
    assert all(result["rows"][0][k] is None for k in report.SPEC_KEYS) and result["settings"]["drafter"] is None
    capsys.readouterr()
    assert main(["bench", "--compare", str(files["json"]), str(plain)]) == 0
    out = capsys.readouterr().out
    assert "B / A" in out and "decode" in out
    rows = [line for line in out.splitlines() if re.match(r"\W*(256|512)\b", line)]
    assert len(rows) == 1 and rows[0].count("x") >= 3  # 512 is only in A; spec figures are "-" in B
    assert main(["bench", "--compare", str(files["json"]), str(files["json"])]) == 0
    assert capsys.readouterr().out.count("x1.00") >= 2 * 5  # a result against itself: every ratio is 1


@pytest.fixture
def not_bench_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"benchmark": "speculative", "rows": []}))
    return path


@pytest.mark.parametrize("args, message", [
    (["--depths", "1x"], "--depths: '1x' is not a positive token count"),
    (["--depths", "1k,,4k"], "--depths: '' is not a positive token count"),
    (["--prompt-file", "/no/such/file.txt"], "--prompt-file '/no/such/file.txt' does not exist"),
    (["--gen", "1"], "--gen must be at least 2"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--compare", "NOT_BENCH", "NOT_BENCH"], "is not a lucebox bench result: no \"schema\""),
    (["--compare", "/no/such.json", "/no/such.json"], "--compare '/no/such.json' does not exist"),
    (["--plot", "out.png"], "--plot needs matplotlib, which is not installed: pip install 'lucebox[plot]'"),
])
def test_bad_flags_print_one_line_and_exit_2(args, message, not_bench_json, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    args = [str(not_bench_json) if a == "NOT_BENCH" else a for a in args]
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lucebox: error: ") and message in err, err


def test_depths_read_k_and_m_suffixes_and_plain_counts():
    assert parse_depths("1k,4k,16k,64k,256k") == (1024, 4096, 16384, 65536, 262144)
    assert parse_depths("2048, 512,2k,1M") == (512, 2048, 1048576)
    for bad in ("", "0", "-1", "1.5k", "4kk"):
        with pytest.raises(InvalidArgumentError):
            parse_depths(bad)


@pytest.mark.parametrize("argv", [
    [],
    ["my model", "--device", "cpu", "--no-cuda-graphs", "--quick", "--depths", "1k,2k", "--json", "r.json"],
    ["--experts-on-host", "--compare", "a b.json", "b.json"],
    ["--no-experts-on-host", "--draft", "none", "--gen", "3"],
])
def test_the_recorded_command_parses_back_to_the_same_flags(argv):
    parser = build_parser()
    args = parser.parse_args(["bench", *argv])
    words = shlex.split(equivalent_command(args))
    assert words[:2] == ["lucebox", "bench"] and len(words) == 2 + len(argv)  # flags at their default are left out
    assert vars(parser.parse_args(words[1:])) == vars(args)


def test_every_request_prefills_from_an_empty_cache():
    prompts = runner._Prompts(list(range(10, 30)), vocab=32)
    first, second = prompts.take(20), prompts.take(20)
    assert first[0] != second[0] and first[1:] == second[1:] == list(range(11, 30))


def test_default_depths_stop_at_16k_on_a_cpu_and_drop_what_does_not_fit(monkeypatch):
    options = EngineConfig(device="cpu", draft=None)
    depths, llm = runner._open_engine(options, runner.BenchSettings(gen=8))
    assert depths == [1024, 4096, 16384] and llm.proposer is None
    real = setup.check_fits

    def small_machine(cfg, settings, *args):
        if settings.max_context > 8192:
            raise ContextLengthError(f"max_context={settings.max_context} does not fit (test)")
        return real(cfg, settings, *args)

    monkeypatch.setattr(setup, "check_fits", small_machine)
    depths, plain = runner._open_engine(options, runner.BenchSettings(gen=8))
    assert depths == [1024, 4096] and plain.max_context == 4096 + 8
    with pytest.raises(ContextLengthError):  # depths asked for are never dropped
        runner._open_engine(options, runner.BenchSettings(depths=(1024, 16384), gen=8))


def test_commit_is_unknown_outside_the_checkout(monkeypatch, tmp_path):
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown", record.commit())
    monkeypatch.setattr(record, "PACKAGE_ROOT", tmp_path)  # an installed package: not a checkout
    assert record.commit() == "unknown"
