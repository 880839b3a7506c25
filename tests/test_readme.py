"""The README's Python chat example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_chat_example_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    section = text[text.index("## Chat"):text.index("## Use it")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (chat example)", "exec"), {})
    assert capsys.readouterr().out.rstrip().endswith("assistant True")
    assert (tmp_path / "conversation.json").is_file()
