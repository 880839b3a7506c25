"""The CLI: --help, info on a config-only folder, generate, and one line + exit 2 for every error."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import EXAMPLES
from safetensors.torch import load_file, save_file

import lucebox
import lucebox.cli
from lucebox.cli import main

LAGUNA_XS2 = EXAMPLES / "laguna-xs2" / "config.json"


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "lucebox.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "info" in out.stdout and "generate" in out.stdout


def test_info_on_laguna_xs2_config_only_folder(tmp_path, capsys):
    shutil.copy(LAGUNA_XS2, tmp_path / "config.json")
    code, out, _ = run_cli(["info", str(tmp_path), "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    assert 33.0e9 < info["parameters_total"] < 33.8e9
    assert 2.8e9 <= info["parameters_active"] <= 3.0e9
    kinds = {a["kind"]: a for a in info["attention"]}
    assert kinds["full"]["layers"] == 10 and kinds["sliding"]["layers"] == 30
    # 8 KV heads x 128 dims x (K and V) x 2 bytes (bf16)
    assert kinds["full"]["kv_bytes_per_token_per_layer"] == 4096
    assert kinds["sliding"]["kv_bytes_per_token_per_layer"] == 4096
    assert kinds["sliding"]["kv_bytes_max_per_layer"] == 4096 * 512
    code, text, _ = run_cli(["info", str(tmp_path)], capsys)
    assert code == 0 and "33.44B total" in text and "sliding" in text and "4096 bytes/token/layer" in text


def test_generate_streams_token_ids(reference_models, capsys):
    folder, _ = reference_models("llama")
    code, out, err = run_cli(["generate", str(folder), "--token-ids", "1,2,3", "--max-tokens", "5",
                              "--device", "cpu", "--ignore-eos"], capsys)
    assert code == 0
    assert len(out.split()) == 5 and "5 tokens (length)" in err
    assert "KV device" not in err


def test_generate_stats_adds_context_and_kv_memory_and_version_prints(capsys):
    code, out, err = run_cli(["generate", "--prompt", "def f(", "--max-tokens", "6", "--ignore-eos", "--stats",
                              "--draft", "auto"], capsys)
    assert code == 0
    figures = err.strip().splitlines()[-1]
    for part in ("6 tokens (length)", "decode ", "prefill ", "acceptance ", "context ", "/4096", "KV device "):
        assert part in figures
    with pytest.raises(SystemExit) as exit_:
        lucebox.cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"lucebox {lucebox.__version__}"


def test_generate_on_dummy_weights(tmp_path, capsys):
    shutil.copy(LAGUNA_XS2, tmp_path / "config.json")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(num_hidden_layers=2, layer_types=cfg["layer_types"][:2], mlp_layer_types=cfg["mlp_layer_types"][:2],
               num_attention_heads_per_layer=cfg["num_attention_heads_per_layer"][:2], hidden_size=256,
               num_experts=8, vocab_size=1000, intermediate_size=512)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = run_cli(["generate", str(tmp_path), "--load-format", "dummy", "--token-ids", "5,6",
                              "--max-tokens", "3", "--device", "cpu", "--ignore-eos"], capsys)
    assert code == 0 and len(out.split()) == 3
    code, quantized, err = run_cli(["generate", str(tmp_path), "--load-format", "dummy", "--token-ids", "5,6",
                                    "--max-tokens", "3", "--device", "cpu", "--ignore-eos", "--quantization", "int4",
                                    "--backend", "torch", "--dtype", "float32"], capsys)
    assert code == 0 and len(quantized.split()) == 3, err


ERROR_CASES = {
    "missing_folder": (lambda d: ["info", str(d / "nowhere")], "does not exist"),
    "no_config": (lambda d: ["info", str(d)], "no config.json"),
    "unsupported": (lambda d: ["info", str(d / "gpt2")],
                    "not supported; supported: Glm4MoeForCausalLM, KimiLinearForCausalLM, Laguna"),
    "bad_json": (lambda d: ["info", str(d / "badjson")], "not valid JSON"),
    "huge_number": (lambda d: ["info", str(d / "hugenumber")], "a number of 5000 characters"),
    "text_without_tokenizer": (lambda d: ["generate", str(d / "llama"), "--prompt", "hi", "--device", "cpu"],
                               "no tokenizer"),
    "context": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1,2", "--ctx", "4", "--device", "cpu"],
                "--ctx is 4"),
    "bad_ids": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1,x", "--device", "cpu"], "--token-ids"),
    "bad_dtype": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1", "--dtype", "int3"], "dtype"),
    "pickle": (lambda d: ["generate", str(d / "pickle"), "--token-ids", "1", "--device", "cpu"], "never unpickles"),
    "corrupt": (lambda d: ["generate", str(d / "corrupt"), "--token-ids", "1", "--device", "cpu"],
                "not a valid safetensors file"),
    "missing_tensor": (lambda d: ["generate", str(d / "missing"), "--token-ids", "1", "--device", "cpu"],
                       "lacks 1 tensor(s)"),
    "unexpected_tensor": (lambda d: ["generate", str(d / "unexpected"), "--token-ids", "1", "--device", "cpu"],
                          "does not use: extra.weight"),
    "misshaped_tensor": (lambda d: ["generate", str(d / "misshaped"), "--token-ids", "1", "--device", "cpu"],
                         "has shape [3]"),
    "bad_backend": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1", "--device", "cpu", "--backend",
                               "cuda"], "backend 'cuda' is not one of auto, torch, triton"),
    "triton_float64": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1", "--device", "cpu", "--backend",
                                  "triton", "--dtype", "float64"], "use --backend torch for this dtype"),
    "bad_quantization": (lambda d: ["generate", str(d / "llama"), "--token-ids", "1", "--device", "cpu",
                                    "--quantization", "int2"], "quantization 'int2' is not one of int8, int4"),
}


@pytest.fixture
def bad_folders(tmp_path, reference_models):
    llama, _ = reference_models("llama")
    shutil.copytree(llama, tmp_path / "llama")
    for name in ("gpt2", "badjson", "hugenumber", "pickle", "corrupt", "missing", "unexpected", "misshaped"):
        shutil.copytree(llama, tmp_path / name)
    for name, change in (("missing", lambda t: t.pop("model.norm.weight")),
                         ("unexpected", lambda t: t.update({"extra.weight": torch.zeros(1)})),
                         ("misshaped", lambda t: t.update({"model.norm.weight": torch.zeros(3)}))):
        tensors = load_file(tmp_path / name / "model.safetensors")
        change(tensors)
        save_file(tensors, tmp_path / name / "model.safetensors")
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "badjson" / "config.json").write_text("{")
    config = (tmp_path / "hugenumber" / "config.json").read_text()  # hidden_size of 5,000 digits; "x" the old one
    (tmp_path / "hugenumber" / "config.json").write_text(config.replace('"hidden_size": ', '"hidden_size": 1'
                                                                        + "0" * 4999 + ', "x": ', 1))
    (tmp_path / "pickle" / "model.safetensors").unlink()
    (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"never read")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 5)
    return tmp_path


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_errors_print_one_line_and_exit_2(case, bad_folders, capsys):
    make_args, message = ERROR_CASES[case]
    code, out, err = run_cli(make_args(bad_folders), capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lucebox: error: ") and message in lines[0]
    assert "Traceback" not in err
