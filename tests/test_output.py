"""No command writes into a folder or file the user already has: train, distill and quantize refuse
an existing OUT without --overwrite, write OUT.partial and rename it when complete, and a run
killed at any point leaves the old OUT as it was."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import lucebox
from lucebox.cli import main
from lucebox.cli.quantize import quantize_checkpoint
from lucebox.output import PARTIAL_MARKER, new_folder, write_new_file


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def users_folder(tmp_path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"precious": true}\n')
    (folder / "model.safetensors").write_bytes(b"weights the user keeps")
    return folder


@pytest.mark.parametrize("command", [
    ["train", "{out}", "--steps", "1"],
    ["distill", "laguna-code-6m", "--out", "{out}", "--steps", "1"],
    ["quantize", "laguna-code-6m", "{out}", "--bits", "8"],
])
def test_no_command_writes_into_an_existing_folder_without_overwrite(users_folder, command, capsys):
    before = _snapshot(users_folder)
    assert main([a.format(out=users_folder) for a in command]) == 2
    assert "already exists; choose a new folder or pass --overwrite" in capsys.readouterr().err
    assert _snapshot(users_folder) == before
    assert not users_folder.with_name("mine.partial").exists()


def test_a_partial_folder_lucebox_did_not_make_is_left_alone(tmp_path):
    theirs = tmp_path / "out.partial"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("not lucebox's")
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="was not made by lucebox"), \
            new_folder(tmp_path / "out", "test"):
        pass
    assert (theirs / "notes.txt").read_text() == "not lucebox's" and not (tmp_path / "out").exists()


def test_a_folder_that_holds_what_the_command_reads_is_refused_even_with_overwrite(users_folder):
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="which this command reads"), \
            new_folder(users_folder.parent, "test", overwrite=True, reads=(users_folder / "config.json",)):
        pass


def test_an_interrupted_run_leaves_what_it_can_go_on_from_or_nothing(tmp_path):
    for written in (False, True):
        with pytest.raises(KeyboardInterrupt), new_folder(tmp_path / "out", "test", resume=True) as partial:
            (partial / "training").mkdir()
            if written:
                (partial / "training" / "state.pt").write_bytes(b"step 1")
            raise KeyboardInterrupt
        assert (tmp_path / "out.partial").exists() == written and not (tmp_path / "out").exists()
    with new_folder(tmp_path / "out", "test", resume=True) as partial:  # goes on from it
        assert (partial / "training" / "state.pt").read_bytes() == b"step 1"
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["state.pt", "training"]


def test_resume_needs_a_finished_run_and_excludes_overwrite(users_folder, capsys):
    assert main(["train", str(users_folder), "--resume", "--steps", "1"]) == 2
    assert "training/state.pt does not exist; nothing to go on from" in capsys.readouterr().err
    assert main(["train", str(users_folder), "--resume", "--overwrite", "--steps", "1"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_an_unwritable_place_and_a_bad_number_are_typed_errors(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["quantize", "laguna-code-6m", str(tmp_path / "file" / "out"), "--bits", "8"]) == 2
    assert "cannot create" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # argparse's flag type refuses it
        main(["train", str(tmp_path / "new"), "--lr", "nan"])
    assert stopped.value.code == 2 and not (tmp_path / "new").exists()
    assert "argument --lr: must be in (0, 1], got nan" in capsys.readouterr().err


def test_a_new_file_replaces_an_old_one_only_when_asked(tmp_path):
    path = tmp_path / "chat.json"
    write_new_file(path, "first")
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="already exists; choose a new file"):
        write_new_file(path, "second")
    write_new_file(path, "second", overwrite=True)
    assert path.read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["chat.json"]


_SLOW_QUANTIZE = """
import sys, time
import lucebox.cli.quantize as q
real = q.save_file
def slow(*args, **kwargs):
    print("shard", flush=True)
    time.sleep(0.03)
    return real(*args, **kwargs)
q.save_file = slow
q.quantize_checkpoint(sys.argv[1], sys.argv[2], 8, shard_bytes=1, overwrite=True)
print("done", flush=True)
"""


def test_a_write_killed_at_a_random_point_leaves_the_old_folder_intact(reference_models, users_folder):
    """SIGKILL while `quantize --overwrite` writes its shards (slowed down): the old OUT is intact, and
    the next run replaces it and leaves nothing else behind."""
    source, _ = reference_models("qwen3_moe")
    before = _snapshot(users_folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(lucebox.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-c", _SLOW_QUANTIZE, str(source), str(users_folder)],
                              stdout=subprocess.PIPE, text=True, env=env)
    assert writer.stdout.readline() == "shard\n"  # writing has begun
    shards = 1
    for _ in range(random.Random(os.getpid()).randrange(1, 12)):
        shards += writer.stdout.readline() == "shard\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert shards >= 2, "the write ended before the kill"
    assert _snapshot(users_folder) == before, f"killed after {shards} shards"
    partial = users_folder.with_name("mine.partial")
    assert (partial / PARTIAL_MARKER).is_file()

    quantize_checkpoint(source, users_folder, 8, overwrite=True)  # starts the partial folder afresh
    assert sorted(p.name for p in users_folder.parent.iterdir()) == ["mine"]
    assert not (users_folder / PARTIAL_MARKER).exists() and "model.safetensors" not in _snapshot(users_folder)
    assert lucebox.LLM(users_folder, device="cpu").generate([1, 2, 3], max_tokens=2).token_ids


def test_a_folder_that_appears_while_the_command_runs_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="already exists"), \
            new_folder(out, "test") as partial:
        (partial / "result").write_text("new")
        out.mkdir()
        (out / "precious").write_text("the user's")
    assert (out / "precious").read_text() == "the user's" and (partial / "result").read_text() == "new"


def test_another_command_s_partial_folder_is_neither_reused_nor_removed(tmp_path):
    with pytest.raises(KeyboardInterrupt), new_folder(tmp_path / "m", "lucebox train", resume=True) as partial:
        (partial / "state.pt").write_bytes(b"an hour of training")
        raise KeyboardInterrupt
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="holds an unfinished `lucebox train` run"), \
            new_folder(tmp_path / "m", "lucebox quantize"):
        pass
    assert (partial / "state.pt").read_bytes() == b"an hour of training"
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="which this command reads"), \
            new_folder(tmp_path / "x", "lucebox quantize", reads=(tmp_path / "x.partial" / "model",)):
        pass
    with pytest.raises(lucebox.errors.InvalidArgumentError, match="is not a folder lucebox can create"), \
            new_folder("/", "test", overwrite=True):
        pass
