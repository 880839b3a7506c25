"""`lucebox chat` as a user meets it: through a pseudo-terminal (pexpect), and piped."""

import io
import json
import os
import re
import subprocess
import sys
import time

import pytest

import lucebox
import lucebox.cli

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _spawn(tmp_path, *flags):
    env = {**os.environ, "HOME": str(tmp_path), "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "200"}
    child = pexpect.spawn(sys.executable, ["-m", "lucebox.cli", "chat", *flags], env=env, encoding="utf-8",
                          timeout=60, dimensions=(50, 200))
    child.expect(">>>")
    return child


def _say(child, line):
    time.sleep(0.2)  # prompt_toolkit drops keys typed before it has switched the terminal to raw mode
    child.sendline(line)


def test_chat_streams_cuts_on_ctrl_c_reuses_the_cache_and_its_commands_work(tmp_path):
    child = _spawn(tmp_path, "--draft", "auto", "--temp", "0", "--max-tokens", "400")
    _say(child, "def parse_args(argv):")
    child.expect(r"\n    \S")  # the answer's first line, long before 400 tokens are done
    assert "tok/s" not in child.before + child.after
    child.sendintr()
    child.expect("cut: the partial answer stays in the history")
    child.expect(">>>")

    _say(child, "import os")  # the next turn reuses everything the cut turn left in the cache
    child.expect(r"prefilled (\d+), reused (\d+)")
    prefilled, reused = int(child.match.group(1)), int(child.match.group(2))
    assert reused > 0 and prefilled < 10
    child.expect(">>>")
    _say(child, "/stats")
    child.expect("tokens per round")
    acceptance = re.search(r"acceptance length\s+([\d.]+)\s*$", ANSI.sub("", child.before))
    assert acceptance and float(acceptance.group(1)) >= 1.0
    child.expect("width histogram")
    child.expect(">>>")

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for line, answer in ((f"/save {a}", "saved 4 messages"), (f"/load {a}", "loaded 4 messages"),
                         (f"/save {b}", "saved 4 messages"), ("/foo", "unknown command /foo"),
                         ("/set temp=abc", "temp must be a number"), ("/set top_p=2", "top_p must be in"),
                         ("/set draft_k=99", "draft_k must be in 1..15"), ("/set max_tokens=3", "set max_tokens=3"),
                         ("/load nowhere.json", "'nowhere.json' does not exist")):
        _say(child, line)
        child.expect(re.escape(answer))
        child.expect(">>>")
    saved = json.loads(a.read_text())
    assert saved == json.loads(b.read_text())
    assert saved["messages"][1]["cut"] is True

    _say(child, "x = 1")  # the chat goes on after the bad commands, with the new max_tokens
    child.expect(r"(\d+) tokens \(")
    assert int(child.match.group(1)) <= 3
    child.expect(">>>")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_at_an_empty_prompt_exits_cleanly(tmp_path):
    child = _spawn(tmp_path)
    time.sleep(0.2)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_piped_stdin_is_one_turn_per_line_in_plain_text(tmp_path):
    lines = "def area(r):\n/set max_tokens=5\nclass Shape:\n/stats\n"
    out = subprocess.run([sys.executable, "-m", "lucebox.cli", "chat", "--temp", "0", "--max-tokens", "12"],
                         input=lines, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert not ANSI.search(out.stdout) and not ANSI.search(out.stderr)
    assert "set max_tokens=5" in out.stdout
    assert "prompt tokens" in out.stdout and "context" in out.stdout
    import lucebox

    chat = lucebox.LLM().chat(temperature=0.0, max_tokens=12)
    first = chat.send("def area(r):").text
    second = chat.send("class Shape:", max_tokens=5).text
    assert out.stdout.startswith(first + "\nset max_tokens=5\n" + second + "\n")


def test_a_failing_line_in_piped_mode_is_one_error_line_and_the_chat_goes_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "mine.json").write_text("mine")
    lines = [b"x" * 20_000,  # longer than the context
             b"/load /dev/zero", b"/load deep.json", b"/load a\0b", b"def f(\xff):",  # not UTF-8
             b"/save mine.json", b"/nothing", b'/save ""', b"/save a b c", b"/save mine.json --force",
             b'/save "open', b"def area(r):", b"/save mine.json --overwrite"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n".join(lines) + b"\n"), encoding="utf-8"))
    code = lucebox.cli.main(["chat", "--temp", "0", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 1  # some line failed
    expected = ["tokens of context", "not a regular file", "more than 110 deep", "NUL character",
                "lone surrogate U\\+DCFF", "already exists", "unknown command /nothing",
                "takes one file name, got 0", "takes one file name, got 3", "does not take --force",
                "No closing quotation"]  # never a file named "" or "a b c"
    errors = err.splitlines()
    assert len(errors) == len(expected)
    for line, pattern in zip(errors, expected, strict=True):
        assert line.startswith("error: ") and re.search(pattern, line), line
    answer = lucebox.LLM().chat(temperature=0.0, max_tokens=6).send("def area(r):").text
    assert out == answer + "\nsaved 2 messages to mine.json\n"  # the turns after the errors ran as if alone
    assert json.loads((tmp_path / "mine.json").read_text())["messages"][1]["content"] == answer
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.json", "mine.json"]
