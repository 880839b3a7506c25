"""The writing commands and the training flags refuse what would do harm or fail late (issue 39):
an output that is empty (an unset shell variable), the current folder, a folder above it or the
home folder is refused whatever --overwrite says, and the user's files survive; every numeric flag
of `lucebox train` and `lucebox distill` is range-checked while the command line is parsed (one
error line, exit code 2, no traceback), and a --config too big for the machine is refused before
anything is allocated; `distill --heads dspark --init` starts from a DSpark drafter."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import lucebox
from lucebox.cli import main
from lucebox.errors import InsufficientMemoryError, InvalidArgumentError
from lucebox.output import new_folder, write_new_file
from lucebox.training.corpus import stdlib_root
from lucebox.training.distill import DistillSettings
from lucebox.training.target import BUILTIN_CONFIG, TrainSettings

SHIPPED_DRAFTER = Path(lucebox.__file__).parent / "data" / "laguna-code-6m" / "dflash"
# a distill run of seconds (if a refusal under test were missing, the test fails instead of training for hours)
TINY_DISTILL = ["--steps", "1", "--batch", "2", "--anchors", "2", "--sequences", "2", "--prompt-tokens", "16",
                "--generated-tokens", "16", "--eval-prompts", "0", "--threads", "1",
                "--data", str(stdlib_root() / "bisect.py")]


@pytest.fixture
def work_folder(tmp_path, monkeypatch) -> Path:
    """A throwaway current folder (inside a throwaway home folder) holding one file of the user's."""
    home = tmp_path / "home"
    work = home / "work"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("the user's")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return work


def _untouched(work: Path) -> bool:
    home = work.parent
    return ((work / "notes.txt").read_text() == "the user's" and sorted(p.name for p in work.iterdir()) == ["notes.txt"]
            and sorted(p.name for p in home.iterdir()) == ["work"] and sorted(home.parent.iterdir()) == [home])


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


TINY_TRAIN = ["--steps", "1", "--batch", "1", "--length", "16", "--vocab-size", "400", "--eval-every", "1",
              "--data", str(stdlib_root() / "bisect.py"), "--eval-data", str(stdlib_root() / "keyword.py")]
WRITERS = {
    "train": ["train", "{out}", "--overwrite", *TINY_TRAIN],
    "distill": ["distill", "laguna-code-6m", "--out", "{out}", "--overwrite", *TINY_DISTILL],
    "quantize": ["quantize", "laguna-code-6m", "{out}", "--bits", "8", "--overwrite"],
}


@pytest.mark.parametrize("out", ["", " ", ".", "..", "~", "/", "./"])
@pytest.mark.parametrize("command", WRITERS)
def test_an_output_that_would_replace_the_users_folders_is_refused_even_with_overwrite(work_folder, command, out,
                                                                                       capsys):
    assert main([arg.format(out=out) for arg in WRITERS[command]]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "is empty" in err or "is not a folder lucebox can create" in err
    assert _untouched(work_folder)


def test_the_cli_refuses_an_unset_variable_as_output_in_a_separate_process(work_folder):
    """`lucebox train "$OUT" --overwrite` with OUT unset: exit code 2, one line, the folder intact."""
    done = subprocess.run([sys.executable, "-m", "lucebox.cli", "train", "", "--overwrite", *TINY_TRAIN],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert _one_error_line(done.stderr) == "lucebox: error: the output folder is empty (an unset variable?); " \
                                          "name a new folder\n"
    assert _untouched(work_folder)


def test_the_python_entry_points_refuse_the_same_outputs(work_folder):
    for out in ("", ".", str(work_folder.parent)):
        with pytest.raises(InvalidArgumentError, match="is empty|is not a folder lucebox can create"), \
                new_folder(out, "test", overwrite=True):
            pass
    with pytest.raises(InvalidArgumentError, match="the output folder is empty"):
        lucebox.cli.quantize.quantize_checkpoint("laguna-code-6m", "", 8, overwrite=True)
    assert _untouched(work_folder)


@pytest.mark.parametrize(("path", "message"), [
    ("", "the output file is empty"), (".", "it is the current folder"), ("..", "it is your home folder"),
    ("../..", "it holds your home folder"), ("sub/", "sub/ is a folder; give a file name"),
    ("sub", "sub is a folder; give a file name"),
])
def test_a_file_is_never_written_over_a_folder(work_folder, path, message):
    """What `/save` and `bench --json` write through: a path naming a folder (an empty one too) is
    refused by what it is, with or without --overwrite."""
    (work_folder / "sub").mkdir()
    for overwrite in (False, True):
        with pytest.raises(InvalidArgumentError, match=message):
            write_new_file(path, "text", overwrite=overwrite)
    (work_folder / "sub").rmdir()
    assert _untouched(work_folder)


def test_overwrite_replaces_regular_files_only_never_a_link_a_fifo_or_a_device(tmp_path, capsys):
    """Renaming a new file over a FIFO, a link (/dev/stdout is one) or a device node (/dev/null) would
    replace the node itself: `/save`, `bench --json` and the rest refuse it even with --overwrite."""
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target.json").write_text("mine\n")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    for name in ("fifo", "link.json"):
        with pytest.raises(InvalidArgumentError, match="not a regular file"):
            write_new_file(tmp_path / name, "text", overwrite=True)
        assert main(["bench", "--json", str(tmp_path / name), "--overwrite"]) == 2
        assert "not a regular file" in capsys.readouterr().err
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "target.json").read_text() == "mine\n"
    with pytest.raises(InvalidArgumentError, match="not a regular file"):  # (never tried on a real /dev node)
        lucebox.LLM(draft=None).chat().save(tmp_path / "fifo", overwrite=True)
    assert (tmp_path / "fifo").is_fifo()
    write_new_file(tmp_path / "target.json", "new\n", overwrite=True)  # a regular file is replaced
    assert (tmp_path / "target.json").read_text() == "new\n"


@pytest.mark.parametrize("command", ["train", "distill"])
def test_training_data_past_the_corpus_bound_is_refused_before_it_is_read(tmp_path, capsys, command):
    """A sparse file of 8 GiB (no disk) named as --data filled host memory until the kernel killed the run."""
    with open(tmp_path / "big.py", "wb") as f:
        f.truncate(8 * 2**30)
    args = ["train", str(tmp_path / "out")] if command == "train" else ["distill", "laguna-code-6m", "--out",
                                                                       str(tmp_path / "out")]
    assert main([*args, "--data", str(tmp_path / "big.py")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the training data is over 1024 MiB" in err


def test_an_output_that_holds_the_init_drafter_is_refused(tmp_path, capsys):
    drafter = tmp_path / "out" / "drafter"
    shutil.copytree(SHIPPED_DRAFTER, drafter)
    assert main(["distill", "laguna-code-6m", "--out", str(tmp_path / "out"), "--init", str(drafter),
                 "--overwrite", *TINY_DISTILL]) == 2
    assert "which this command reads" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in drafter.iterdir()) == sorted(p.name for p in SHIPPED_DRAFTER.iterdir())


@pytest.mark.parametrize("command", ["train --data", "train --config", "quantize", "distill"])
def test_an_output_that_holds_what_the_command_reads_is_refused_even_with_overwrite(tmp_path, command, capsys):
    source = tmp_path / "out" / "source"
    shutil.copytree(Path(lucebox.__file__).parent / "data" / "laguna-code-6m", source)
    argv = {"train --data": ["train", "{out}", "--data", str(source / "config.json"), *TINY_TRAIN[:-4]],
            "train --config": ["train", "{out}", "--config", str(source / "config.json"), *TINY_TRAIN],
            "quantize": ["quantize", str(source), "{out}", "--bits", "8"],
            "distill": ["distill", str(source), "--out", "{out}", *TINY_DISTILL]}[command]
    before = sorted(p.relative_to(source) for p in source.rglob("*"))
    assert main([arg.format(out=tmp_path / "out") for arg in argv] + ["--overwrite"]) == 2
    assert "which this command reads; choose another folder" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.relative_to(source) for p in source.rglob("*")) == before


BAD_FLAGS = [
    (["train", "{out}", "--threads", "-2"], "--threads: must be in 1..1024, got -2"),
    (["train", "{out}", "--steps", "0"], "--steps: must be in 1..1000000000, got 0"),
    (["train", "{out}", "--batch", "-1"], "--batch: must be in 1..65536, got -1"),
    (["train", "{out}", "--length", "1"], "--length: must be in 2..1048576, got 1"),
    (["train", "{out}", "--lr", "nan"], "--lr: must be in (0, 1], got nan"),
    (["train", "{out}", "--vocab-size", "10"], "--vocab-size: must be in 260..262144, got 10"),
    (["train", "{out}", "--seed", "-1"], "--seed: must be in 0..9223372036854775807, got -1"),
    (["train", "{out}", "--eval-every", "x"], "--eval-every: must be an integer, got 'x'"),
    (["distill", "t", "--out", "{out}", "--threads", "-1"], "--threads: must be in 1..1024, got -1"),
    (["distill", "t", "--out", "{out}", "--generated-tokens", "-5"], "--generated-tokens: must be in 0..65536, got -5"),
    (["distill", "t", "--out", "{out}", "--eval-prompts", "-1"], "--eval-prompts: must be in 0..4096, got -1"),
    (["distill", "t", "--out", "{out}", "--eval-tokens", "0"], "--eval-tokens: must be in 1..65536, got 0"),
    (["distill", "t", "--out", "{out}", "--kv-heads", "0"], "--kv-heads: must be in 1..256, got 0"),
    (["distill", "t", "--out", "{out}", "--block-size", "1"], "--block-size: must be in 2..256, got 1"),
    (["distill", "t", "--out", "{out}", "--sequences", "0"], "--sequences: must be in 1..10000000, got 0"),
    (["distill", "t", "--out", "{out}", "--mask-token-id", "-3"], "--mask-token-id: must be in 0..2147483647, got -3"),
    (["distill", "t", "--out", "{out}", "--target-layers", "1,-2"], "--target-layers: layer indices are 0 or more"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join([a[0], *a[-2:]]) for a, _ in BAD_FLAGS])
def test_a_training_flag_out_of_range_stops_the_parse(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([arg.format(out=tmp_path / "out") for arg in argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in err and err.count("\n") == 1  # one line, no usage block
    assert err.startswith(f"lucebox {argv[0]}: error: argument {message}"), err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("flags", "message"), [
    (["--attention-heads", "3", "--kv-heads", "2"], "--attention-heads 3 is not a multiple of --kv-heads 2"),
    (["--head-dim", "7"], "--head-dim 7 must be even"),
    (["--prompt-tokens", "4", "--generated-tokens", "0"], "are too short for --anchors distinct blocks"),
    (["--freeze-backbone"], "--freeze-backbone trains the DSpark heads of an --init drafter"),
    (["--markov-rank", "0"], "--markov-rank must be in 1..65536, got 0"),
])
def test_distill_flags_that_contradict_each_other_stop_before_any_work(tmp_path, flags, message, capsys):
    assert main(["distill", "laguna-code-6m", "--out", str(tmp_path / "out"), *TINY_DISTILL, *flags]) == 2
    assert message in _one_error_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


def test_the_python_entry_points_check_the_same_ranges():
    with pytest.raises(InvalidArgumentError, match="--attention-heads 3 is not a multiple of --kv-heads 2"):
        DistillSettings(attention_heads=3, kv_heads=2)
    with pytest.raises(InvalidArgumentError, match="--generated-tokens must be in 0..65536, got -5"):
        DistillSettings(generated_tokens=-5)
    with pytest.raises(InvalidArgumentError, match="--steps must be in 1..1000000000, got 0"):
        TrainSettings(steps=0)
    from lucebox.training import distill_command, train_command

    with pytest.raises(InvalidArgumentError, match="--eval-tokens must be in 1..65536, got 0"):
        distill_command.run("no-such-model", Path("unused"), None, None, DistillSettings(), None, None,
                            eval_tokens=0)
    with pytest.raises(InvalidArgumentError, match="--threads must be in 1..1024, got -1"):
        distill_command.run("no-such-model", Path("unused"), None, None, DistillSettings(), -1, None)
    with pytest.raises(InvalidArgumentError, match="--threads must be in 1..1024, got -2"):
        train_command.run(Path("unused"), None, None, TrainSettings(), 4096, -2)


def test_a_config_too_big_for_the_machine_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    from lucebox.training import memory_bound, train_command

    monkeypatch.setattr(memory_bound, "_host_available", lambda: 32 * 2**30)  # the same answer on any machine
    train_command.check_architecture(BUILTIN_CONFIG, 4096, TrainSettings(), "the built-in model")  # the recipe fits
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BUILTIN_CONFIG, "hidden_size": 65536}))
    assert main(["train", str(tmp_path / "out"), "--config", str(config), "--steps", "1"]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{config}: hidden_size 65536 (a model of" in err and "make hidden_size smaller" in err
    assert sorted(tmp_path.iterdir()) == [config]
    with pytest.raises(InsufficientMemoryError, match="hidden_size 65536"):
        train_command.run(tmp_path / "out", None, None, TrainSettings(), 4096, None,
                          architecture={**BUILTIN_CONFIG, "hidden_size": 65536})
    with pytest.raises(InsufficientMemoryError, match="^--batch 65536 x --length 1048576 needs about"):
        train_command.check_architecture({**BUILTIN_CONFIG, "max_position_embeddings": 2**20}, 4096,
                                         TrainSettings(batch=65536, length=2**20), "the built-in model")


def test_distill_buffers_too_big_for_the_machine_are_refused_before_allocating(tmp_path, monkeypatch, capsys):
    from lucebox.models import dflash

    from lucebox.checkpoints.loading import describe_model
    from lucebox.training import memory_bound

    monkeypatch.setattr(memory_bound, "_host_available", lambda: 32 * 2**30)  # the same answer on any machine
    target = describe_model("laguna-code-6m").cfg
    drafter = dflash.build_config(json.loads((SHIPPED_DRAFTER / "config.json").read_text()))
    memory_bound.check_distill_fits(target, drafter, DistillSettings())  # the built-in recipe fits
    with pytest.raises(InsufficientMemoryError, match=r"^--sequences 10000000 x 65664 tokens .*: the target's "):
        memory_bound.check_distill_fits(target, drafter, DistillSettings(sequences=10**7, prompt_tokens=2**16))
    with pytest.raises(InsufficientMemoryError, match=r"^--batch 4096 x --anchors 4096 x --block-size 8: a step's"):
        memory_bound.check_distill_fits(target, drafter, DistillSettings(batch=4096, anchors=4096, prompt_tokens=5000))
    mtp = DistillSettings(heads="mtp")
    memory_bound.check_distill_fits(target, None, mtp)  # an MTP head: the built-in recipe fits
    with pytest.raises(InsufficientMemoryError, match=r"^--batch 4096 x 5128 tokens: a step's soft labels"):
        memory_bound.check_distill_fits(target, None, DistillSettings(heads="mtp", batch=4096, prompt_tokens=5000))
    assert main(["distill", "laguna-code-6m", "--out", str(tmp_path / "out"), *TINY_DISTILL, "--sequences", "10000000",
                 "--prompt-tokens", "65536"]) == 2
    assert "the target's features need about" in _one_error_line(capsys.readouterr().err)
    assert not any(tmp_path.iterdir())


def test_distill_goes_on_from_the_shipped_dspark_drafter_with_its_heads(tmp_path):
    """`--heads dspark --init` a DSpark-layout drafter: its backbone and its heads are where training
    starts (at a learning rate too small to move them, the written heads are the shipped ones)."""
    out = tmp_path / "drafter"
    assert main(["distill", "laguna-code-6m", "--out", str(out), "--heads", "dspark", "--init", str(SHIPPED_DRAFTER),
                 *TINY_DISTILL, "--lr", "1e-12"]) == 0
    config = json.loads((out / "config.json").read_text())
    shipped = json.loads((SHIPPED_DRAFTER / "config.json").read_text())
    assert config["architectures"] == ["DSparkSpeculator"] and config["markov_rank"] == shipped["markov_rank"]
    written, started = load_file(out / "model.safetensors"), load_file(SHIPPED_DRAFTER / "model.safetensors")
    assert written.keys() == started.keys()
    for name in ("markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"):
        assert (written[name].float() - started[name].float()).abs().max() < 1e-3, name


def test_a_plain_dflash_drafter_starts_from_a_dspark_drafters_backbone_only():
    from lucebox.models import dflash

    from lucebox.training.drafter_start import load_start

    with pytest.warns(lucebox.errors.LuceboxWarning, match="--heads dflash writes a plain DFlash drafter"):
        backbone = load_start(SHIPPED_DRAFTER, with_heads=False)
    with_heads = load_start(SHIPPED_DRAFTER, with_heads=True)
    assert set(with_heads) - set(backbone) == {"markov_w1", "markov_w2", "confidence_w", "confidence_b"}
    assert not any(name.startswith(("markov", "confidence")) for name in backbone)
    assert all(name in dflash.weight_shapes(dflash.build_config(json.loads((SHIPPED_DRAFTER / "config.json")
                                                                            .read_text()))) for name in with_heads)



def test_no_held_out_prompt_is_taken_when_none_are_asked_for():
    """--eval-prompts 0 writes the drafter without the acceptance measurement (it used to read every
    held-out text and measure on all of them)."""
    from lucebox.training.distill_command import held_out_prompts

    class Tokenizer:
        def encode(self, text):
            return list(range(len(text)))

    texts = ["x" * 100, "y" * 100]
    assert held_out_prompts(Tokenizer(), texts, 0, 64) == []
    assert held_out_prompts(Tokenizer(), texts, 1, 64) == [list(range(64))]


def test_output_paths_are_where_the_system_puts_them_and_a_symlink_loop_is_an_error(tmp_path, monkeypatch):
    """`link/../x` is beside the link's target, as the system resolves it (a lexical `..` wrote over
    the file beside the link instead); a symlink loop or `~nobody` is a typed error, not a RuntimeError."""
    (tmp_path / "w").mkdir()
    (tmp_path / "other" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "w")
    Path("sub").symlink_to("../other/deep")
    Path("chat.json").write_text("mine\n")
    write_new_file("sub/../chat.json", "new\n", overwrite=True)
    assert Path("chat.json").read_text() == "mine\n" and (tmp_path / "other" / "chat.json").read_text() == "new\n"
    Path("a").symlink_to("b")
    Path("b").symlink_to("a")
    for name, message in (("a", "Symlink loop|Too many levels"), ("a/chat.json", "Symlink loop|Too many levels"),
                          ("~nosuchuser-lucebox/x.json", "no home folder")):
        with pytest.raises(InvalidArgumentError, match=message):
            write_new_file(name, "x")
    assert main(["bench", "--json", "~nosuchuser-lucebox/r.json"]) == 2


def test_training_text_keeps_text_mode_newlines(tmp_path):
    from lucebox.training.corpus import read_texts

    (tmp_path / "crlf.py").write_bytes(b"a = 1\r\nb = 2\rc = 3\n")
    assert read_texts([tmp_path / "crlf.py"]) == [(tmp_path / "crlf.py").read_text()] == ["a = 1\nb = 2\nc = 3\n"]


@pytest.mark.parametrize("rest, name", [(r"a\b.json", r"a\b.json"), ('"my chat.json" --overwrite', "my chat.json"),
                                        ("x#y.json", "x#y.json")])
def test_a_chat_file_name_is_split_as_a_shell_splits_it_and_keeps_its_backslashes(rest, name):
    from lucebox.chat.slash_commands import OVERWRITE, ChatCommands

    commands = ChatCommands(None, None, None)  # naming the file needs no session
    assert commands._file(rest, "/save", (OVERWRITE,))[0] == name
