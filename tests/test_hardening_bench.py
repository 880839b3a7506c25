"""`lucebox bench` trusts none of its inputs and never loses its results: --compare and --prompt-file
read only regular files, within a bound; a result file is type-checked before any field is used;
every output file is checked before the run (no folder, no file the user has unless --overwrite, a
folder that takes a new file) and a write that fails at the end still leaves the table on screen.

No test here loads a model: `measure` is replaced by one that returns a fixed result, or fails the
test if a refusal came too late."""

from __future__ import annotations

import copy
import json
import os
import threading
from pathlib import Path

import pytest

from lucebox.benchmark import command, outputs, report, runner
from lucebox.cli import main
from lucebox.errors import InvalidArgumentError


def a_result() -> dict:
    """A small, valid bench result: two depths, speculative figures on the first only."""
    figures = {f"{speed}{end}": 100.0 for speed in report.SPEEDS for end in ("", "_min", "_max")}
    sizes = {"kv_device_bytes": 4096, "kv_host_bytes": 0, "peak_memory_bytes": 2**20}
    spec = {"spec_speedup": 1.5, "acceptance_length": 2.5, "drafts_per_round": 3.0}
    plain = {key: None for key in report.SPEC_KEYS}
    return {"schema": report.SCHEMA, "date": "2026-12-07T00:00:00Z", "commit": "0" * 40, "lucebox": "0.1.0",
            "command": "lucebox bench", "machine": {"processor": "x86_64", "torch_threads": 2},
            "model": {"name": "test-model"},
            "settings": {"device": "cpu", "dtype": "float32", "prompt": "random token ids", "gen": 8, "repeat": 1,
                         "drafter": "a/dflash", "kv_policy": "exact", "kv_pool_tokens": 520},
            "memory": {"peak_memory": "process_peak_rss"},
            "rows": [{"depth": 256, **figures, **spec, **sizes}, {"depth": 512, **figures, **sizes, **plain}]}


@pytest.fixture
def no_run(monkeypatch):
    """A refusal must come before the run: a run that starts fails the test."""
    def started(*args):
        raise AssertionError("the benchmark ran: the refusal came too late")

    monkeypatch.setattr(command, "measure", started)


@pytest.fixture
def fake_run(monkeypatch):
    """The run returns `a_result()` at once, so every output is written without a model."""
    monkeypatch.setattr(command, "measure", lambda args, settings: a_result())


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lucebox: error: ") and "Traceback" not in err, err
    return err


def write_result(path: Path, result: object) -> Path:
    path.write_text(json.dumps(result))
    return path


# --- inputs: only regular files, within a bound ---------------------------------------------------

@pytest.mark.parametrize("flag", ["--compare", "--prompt-file"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(flag, tmp_path, no_run, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = ["bench", flag, str(fifo), *([str(fifo)] if flag == "--compare" else [])]
    codes = []
    reader = threading.Thread(target=lambda: codes.append(main(args)), daemon=True)
    reader.start()
    reader.join(timeout=5)
    hung = reader.is_alive()
    if hung:  # release the reader stuck in open(): a writer that closes at once gives it an empty read
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
    assert not hung, f"{flag} of a FIFO waited for a writer"
    assert codes == [2]
    assert "is not a regular file" in one_error_line(capsys)


@pytest.mark.parametrize("flag", ["--compare", "--prompt-file"])
def test_a_device_is_refused_before_any_read(flag, no_run, capsys):
    args = ["bench", flag, "/dev/zero", *(["/dev/zero"] if flag == "--compare" else [])]
    assert main(args) == 2
    assert f"{flag} '/dev/zero' is not a regular file" in one_error_line(capsys)


@pytest.mark.parametrize("flag, bound", [("--compare", report.MAX_RESULT_BYTES),
                                         ("--prompt-file", runner.MAX_PROMPT_FILE_BYTES)])
def test_a_file_past_the_bound_is_refused_unread(flag, bound, tmp_path, no_run, capsys):
    big = tmp_path / "big"
    with big.open("wb") as f:
        f.truncate(bound + 1)  # sparse: nothing is written, and a read of it would take all of it
    args = ["bench", flag, str(big), *([str(big)] if flag == "--compare" else [])]
    assert main(args) == 2
    assert f"is larger than {bound} bytes" in one_error_line(capsys)


def test_a_file_at_the_bound_is_read(tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("x = 1\n")
    assert runner.read_prompt_file(text) == "x = 1\n"


def test_compare_of_deeply_nested_json_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["bench", "--compare", str(deep), str(deep)]) == 2
    assert "more than 100 deep" in one_error_line(capsys)


# --- a result file: every field the tables read has the type they need --------------------------

def test_a_valid_result_compares(tmp_path, capsys):
    a = write_result(tmp_path / "a.json", a_result())
    assert main(["bench", "--compare", str(a), str(a)]) == 0
    assert capsys.readouterr().out.count("x1.00") >= 5


def _set(result: dict, where: str, value: object) -> dict:
    """`result` with the field at `where` ("model", "settings.gen", "rows.0.depth") set to `value`."""
    result = copy.deepcopy(result)
    *parents, last = where.split(".")
    holder = result
    for key in parents:
        holder = holder[int(key)] if isinstance(holder, list) else holder[key]
    holder[int(last) if isinstance(holder, list) else last] = value
    return result


@pytest.mark.parametrize("where, value, message", [
    ("model", 7, "'model' is not an object"),
    ("model.name", 7, "'model.name' is 7, not a string"),
    ("machine", ["x"], "'machine' is not an object"),
    ("machine.torch_threads", "two", "'machine.torch_threads' is 'two', not an integer or null or absent"),
    ("machine.processor", 3.5, "'machine.processor' is 3.5, not a string or null or absent"),
    ("settings", None, "'settings' is not an object"),
    ("settings.device", 0, "'settings.device' is 0, not a string"),
    ("settings.repeat", True, "'settings.repeat' is True, not an integer"),
    ("memory.peak_memory", None, "'memory.peak_memory' is None, not a string"),
    ("commit", 12, "'commit' is not a string"),
    ("date", [], "'date' is not a string"),
    ("rows", {"depth": 1}, "'rows' is not a list"),
    ("rows", [], "'rows' is not a non-empty list"),
    ("rows.0", "a row", "a row has no positive integer depth"),
    ("rows.0.depth", True, "a row has no positive integer depth"),
    ("rows.1.decode_tokens_per_s", "fast", "depth 512: decode_tokens_per_s is 'fast', not a finite number"),
    ("rows.0.spec_speedup", [1.5], "depth 256: spec_speedup is [1.5], not a finite number"),
    ("rows.0.kv_host_bytes", -1, "depth 256: kv_host_bytes is -1, not positive"),
])
def test_compare_of_a_field_of_the_wrong_type_is_one_line(where, value, message, tmp_path, capsys):
    good = write_result(tmp_path / "good.json", a_result())
    bad = write_result(tmp_path / "bad.json", _set(a_result(), where, value))
    assert main(["bench", "--compare", str(good), str(bad)]) == 2
    err = one_error_line(capsys)
    assert "is not a lucebox bench result" in err and message in err, err


def test_names_in_a_result_are_shown_as_written_not_read_as_markup(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a short name, so the title line does not wrap inside it
    write_result(tmp_path / "[b].json", _set(_set(a_result(), "model.name", "[/bold] $x$ [red]"), "machine.gpu", "[/]"))
    assert main(["bench", "--compare", "[b].json", "[b].json"]) == 0
    assert "A [b].json: [/bold] $x$ [red] on cpu ([/])" in capsys.readouterr().out


def test_a_result_that_holds_unencodable_text_is_refused(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_bytes(b'{"schema": "\xff"}')
    assert main(["bench", "--compare", str(a), str(a)]) == 2
    assert "is not UTF-8 text" in one_error_line(capsys)


# --- the prompt file ------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", " \n\t\n"])
def test_an_empty_prompt_file_is_refused_before_the_model_loads(text, tmp_path, no_run, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    assert main(["bench", "--prompt-file", str(prompt)]) == 2
    assert f"--prompt-file '{prompt}' holds no text to tile" in one_error_line(capsys)


class _NoTokens:
    """A tokenizer whose text encodes to nothing but the BOS it adds when asked."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] if add_special_tokens else []


def test_a_prompt_that_encodes_to_no_tokens_is_refused_not_tiled_as_bos():
    class Model:
        tokenizer = _NoTokens()

    settings = runner.BenchSettings(prompt_file=Path("p.txt"), prompt_text="\u200b")
    with pytest.raises(InvalidArgumentError, match="holds no text to tile"):
        runner._prompt_body(Model(), settings, 64)


# --- outputs: checked before the run, never replacing a file without --overwrite ------------------

@pytest.mark.parametrize("flag", ["--json", "--csv", "--md", "--plot"])
@pytest.mark.parametrize("name, message", [("folder", "is a folder; give a file name"),
                                           ("new-folder/", "is a folder; give a file name"),
                                           (".", "it is the current folder"), ("", "is empty")])
def test_an_output_naming_a_folder_is_refused_before_the_run(flag, name, message, tmp_path, monkeypatch, no_run,
                                                             capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    assert main(["bench", flag, name]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("where, message", [
    ("no/such/folder/r.md", "does not exist"),
    ("a-file/r.md", "a-file' is not a folder"),
    ("/sys/r.md", "cannot write in '/sys'"),  # refused even to root, whom os.access lets write anywhere
])
def test_an_output_in_a_folder_that_takes_no_file_is_refused_before_the_run(where, message, tmp_path, no_run,
                                                                              capsys):
    if where.startswith("/sys") and not os.path.isdir("/sys"):
        pytest.skip("no /sys here")
    (tmp_path / "a-file").write_text("x")
    target = where if where.startswith("/") else str(tmp_path / where)
    assert main(["bench", "--md", target]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--csv", "r.csv"), ("--md", "r.md"),
                                        ("--plot", "r.png")])
def test_an_existing_output_is_kept_without_overwrite_and_replaced_with_it(flag, name, tmp_path, monkeypatch,
                                                                            capsys):
    existing = tmp_path / name
    existing.write_text("the user's file\n")
    monkeypatch.setattr(command, "measure", lambda *a: pytest.fail("the run started before the refusal"))
    assert main(["bench", flag, str(existing)]) == 2
    assert "already exists; choose a new file or pass --overwrite" in one_error_line(capsys)
    assert existing.read_text() == "the user's file\n"
    monkeypatch.setattr(command, "measure", lambda args, settings: a_result())
    assert main(["bench", flag, str(existing), "--overwrite"]) == 0
    data = existing.read_bytes()
    assert data != b"the user's file\n"
    if flag == "--plot":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    if flag == "--json":
        assert json.loads(data) == a_result()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary sibling left behind


def test_every_output_is_written_through_a_sibling_with_the_figures(tmp_path, fake_run, capsys):
    files = {flag: tmp_path / f"r.{ext}" for flag, ext in (("--json", "json"), ("--csv", "csv"), ("--md", "md"),
                                                           ("--plot", "png"))}
    assert main(["bench", *[w for flag, path in files.items() for w in (flag, str(path))]]) == 0
    assert json.loads(files["--json"].read_text()) == a_result()
    assert files["--csv"].read_text().splitlines()[1].startswith("test-model,cpu,256,")
    assert "| 512 |" in files["--md"].read_text()
    assert files["--plot"].read_bytes()[:4] == b"\x89PNG"
    assert oct(files["--plot"].stat().st_mode & 0o777) == oct(files["--json"].stat().st_mode & 0o777)
    assert capsys.readouterr().err.startswith("wrote ")


def test_two_outputs_naming_one_file_are_refused(tmp_path, no_run, capsys):
    same = str(tmp_path / "r.txt")
    assert main(["bench", "--json", same, "--md", same]) == 2
    assert "give each output its own file" in one_error_line(capsys)


def test_an_output_over_the_prompt_file_is_refused_even_with_overwrite(tmp_path, no_run, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f():\n    return 1\n")
    assert main(["bench", "--prompt-file", str(prompt), "--md", str(prompt), "--overwrite"]) == 2
    assert "is also the file the run reads" in one_error_line(capsys)


def test_an_output_that_is_a_device_is_refused_even_with_overwrite(no_run, capsys):
    assert main(["bench", "--json", "/dev/null", "--overwrite"]) == 2
    assert "exists and is not a regular file" in one_error_line(capsys)


def test_a_write_that_fails_after_the_run_names_what_was_lost_and_keeps_the_rest(tmp_path, fake_run, monkeypatch,
                                                                                   capsys):
    real = outputs.write_new_file

    def disk_full(path, text, **kwargs):
        if Path(path).suffix == ".json":
            raise InvalidArgumentError(f"cannot write {path}: No space left on device")
        return real(path, text, **kwargs)

    monkeypatch.setattr(outputs, "write_new_file", disk_full)
    result, table = tmp_path / "r.json", tmp_path / "r.md"
    assert main(["bench", "--json", str(result), "--md", str(table)]) == 2
    captured = capsys.readouterr()
    assert "| 256 " in captured.out.replace("┃", "|").replace("│", "|")  # the figures were printed
    err = captured.err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "not written: --json (cannot write" in err and "No space left on device" in err
    assert f"wrote {table}" in err and "the figures are in the table above" in err
    assert not result.exists() and "| 512 |" in table.read_text()


def test_a_png_that_appeared_during_the_run_is_not_replaced(tmp_path, monkeypatch, capsys):
    png = tmp_path / "r.png"

    def run_while_a_user_writes(args, settings):
        png.write_text("made during the run\n")
        return a_result()

    monkeypatch.setattr(command, "measure", run_while_a_user_writes)
    assert main(["bench", "--plot", str(png)]) == 2
    assert "already exists; choose a new file or pass --overwrite" in one_error_line(capsys)
    assert png.read_text() == "made during the run\n"


def test_a_prompt_file_is_tiled_without_a_bos_at_each_seam_and_only_what_the_depth_needs_is_encoded():
    from lucebox.builtin import BUILTIN_MODEL
    from lucebox.text.tokenizer_files import load_tokenizer

    class Model:
        tokenizer = load_tokenizer(BUILTIN_MODEL, json.loads((BUILTIN_MODEL / "config.json").read_text()), None)

    short = runner.BenchSettings(prompt_file=Path("p.txt"), prompt_text="def f(x):\n    return x + 1\n")
    body = runner._prompt_body(Model(), short, 200)
    assert len(body) == 200 and Model.tokenizer.bos_token_id not in body
    long_text = "value = compute(value, 17)\n" * 50_000
    cut = runner._prompt_body(Model(), runner.BenchSettings(prompt_file=Path("p.txt"), prompt_text=long_text), 300)
    assert cut == Model.tokenizer.encode(long_text, add_special_tokens=False)[:300]
