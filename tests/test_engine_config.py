"""One engine configuration: every default and limit defined once, read by the library, the CLI and
the planner alike; every flag's default shown in --help; the built-in model named by every command;
a context past the model's trained length warned about."""

import argparse
import ast
import json
import warnings
from pathlib import Path

import pytest

import lucebox
from lucebox import limits
from lucebox.cli import build_parser, main
from lucebox.cli.help import help_text
from lucebox.engine.config import EngineConfig
from lucebox.engine_flags import engine_config
from lucebox.errors import InvalidArgumentError, LuceboxWarning
from lucebox.limits import DECODE_ROWS, DRAFT_CTX, DRAFT_WIDTH, KV_RESELECT_EVERY

ROOT = Path(__file__).resolve().parents[1]
# Settings whose defaults belong to `lucebox.limits`: a parameter or field of these names
# anywhere else may default to one of its constants (or None), never to a number of its own.
ENGINE_SETTINGS = {"draft_ctx", "reselect_every", "kv_reselect_every", "max_width", "draft_k", "decode_rows",
                   "prefill_chunk", "kv_pool_tokens", "pool_tokens", "tail_tokens", "max_step", "max_context"}


def _numeric_defaults(tree: ast.AST):
    """(name, line) of every parameter default and class field default that is a number literal."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            yield from ((a.arg, d) for a, d in pairs)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            yield node.target.id, node.value


def test_engine_defaults_are_defined_once():
    strays = []
    for folder in ("lucebox", "models", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "lucebox" / "engine" / "config.py":
                continue
            for name, value in _numeric_defaults(ast.parse(path.read_text())):
                if name in ENGINE_SETTINGS and isinstance(value, ast.Constant) and isinstance(value.value, int) \
                        and not isinstance(value.value, bool) and value.value != 0:  # 0: "none", not a size
                    strays.append(f"{path.relative_to(ROOT)}:{value.lineno} {name}={value.value}")
    assert strays == []


def test_the_library_and_the_cli_share_the_defaults():
    config = EngineConfig()
    assert (config.draft_k, config.draft_ctx, config.kv_reselect_every) == (DRAFT_WIDTH, DRAFT_CTX, KV_RESELECT_EVERY)
    assert DRAFT_WIDTH == DECODE_ROWS - 1
    for command in ("generate", "chat", "serve", "bench"):  # a flag left out is left to EngineConfig
        args = build_parser().parse_args([command] + (["--prompt", "x"] if command == "generate" else []))
        expected = EngineConfig(draft="auto") if command == "bench" else config  # bench drafts by default
        assert engine_config(args) == expected, command


def test_the_kernels_tiles_hold_the_widest_step():
    """Kernels choose their own tile sizes; the widest verify step must still take their decode
    path (the torch MoE reference reads nothing on the host there; the Triton one uses its
    narrow decode tiles)."""
    from lucebox.kernels import moe, moe_triton

    assert DECODE_ROWS <= moe.SMALL_STEP_ROWS and DECODE_ROWS <= moe_triton.DEDUP_ROWS


def test_every_flag_of_every_command_shows_its_default():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {action.option_strings[0]}" for name, sub in commands.choices.items()
               for action in sub._actions
               if action.option_strings and action.default is not argparse.SUPPRESS
               and "default" not in help_text(action)]
    assert missing == []
    assert "(default: 128)" in commands.choices["generate"].format_help().replace("\n", " ").replace("  ", " ")


def test_config_values_are_checked_where_they_are_given():
    with pytest.raises(InvalidArgumentError, match="draft_k"):
        EngineConfig(draft_k=DRAFT_WIDTH + 1)
    assert EngineConfig(draft="none").draft is None  # as the CLI's --draft none (was a folder named "none")
    with pytest.raises(InvalidArgumentError, match="vram_budget"):
        EngineConfig(vram_budget="lots")
    assert EngineConfig(expert_slots=4).experts_on_host  # asking for a cache size asks for the cache
    assert EngineConfig(vram_budget="1GiB").vram_budget == 2**30


def test_the_builtin_model_has_a_name_every_command_takes(capsys):
    from lucebox.builtin import BUILTIN_MODEL
    from lucebox.checkpoints.loading import describe_model

    assert describe_model("laguna-code-6m").folder == describe_model(None).folder == BUILTIN_MODEL
    assert main(["info", "laguna-code-6m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["folder"] == str(BUILTIN_MODEL)


def test_a_context_past_the_trained_length_is_warned_about(reference_models, capsys):
    folder, _ = reference_models("llama")
    trained = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    with pytest.warns(LuceboxWarning, match=f"beyond the {trained} tokens"):
        lucebox.LLM(folder, device="cpu", max_context=trained + 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the trained length: no warning at all
        lucebox.LLM(folder, device="cpu", max_context=trained)
    assert main(["generate", str(folder), "--device", "cpu", "--ctx", str(trained + 64), "--token-ids", "1,2",
                 "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert f"lucebox: warning: --ctx {trained + 64} is beyond the {trained} tokens" in err


def test_limits_are_what_the_engine_is_sized_by(reference_models):
    llm = lucebox.LLM(reference_models("llama")[0], device="cpu")
    assert llm.setup.cache.decode_rows == DECODE_ROWS and llm.engine_config == EngineConfig(
        reference_models("llama")[0], device="cpu")
    assert limits.PREFILL_CHUNK["cpu"] == llm.setup.prefill_chunk
