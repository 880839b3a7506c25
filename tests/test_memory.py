"""Loading reads one tensor at a time: peak memory stays near one copy of the weights."""

import json
import subprocess
import sys

import torch
from safetensors.torch import save_file

MEASURE = r"""
import sys
import lucebox
from lucebox.speculative.proposer import tensor_bytes
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
before = status("VmRSS")
llm = lucebox.LLM(sys.argv[1], device="cpu", dtype="float32")
# Views counted once: an attention layer's wq, wk, wv are views of its fused projection.
weights = tensor_bytes(llm.engine.decoder.w.values())
print(before, status("VmHWM"), weights)
"""


def write_big_llama(folder, hidden=1024, layers=2, vocab=16384, inter=4096):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
              "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "model.norm.weight": torch.ones(hidden),
         "lm_head.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v", "o"):
            t[f"{p}self_attn.{n}_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        t[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g)
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(t, folder / "model.safetensors")
    return sum(x.numel() * 4 for x in t.values())


def test_loading_never_holds_two_copies_of_the_weights(tmp_path):
    model_bytes = write_big_llama(tmp_path)
    assert model_bytes > 200 * 2**20
    out = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path)], capture_output=True, text=True, check=True)
    before, peak, weights = (int(x) for x in out.stdout.split())
    assert weights == model_bytes
    growth = peak - before
    # One copy plus the largest single tensor in flight (64 MiB here); two copies would be >= 2x.
    message = f"peak grew by {growth / 2**20:.0f} MiB for {model_bytes / 2**20:.0f} MiB of weights"
    assert growth < 1.4 * model_bytes, message
