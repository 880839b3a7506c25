"""The MTP head of a llama.cpp GGUF file (blk.N.nextn.* beside the head's layer as block N, after
the model's N blocks): loaded by draft='auto' as the same head the Hugging Face layout holds, and
lossless."""

import copy
import json

import gguf
import pytest
import torch
from gguf_bytes import read_layout, write_layout
from gguf_hybrid_models import ARCHES, _layout, _metadata, _value_change, write_converted, write_hybrid_gguf
from mtp_cases import head_over, target_hidden
from safetensors.torch import save_file
from test_mtp import BIASES, PROMPT

import lucebox
from lucebox.errors import DraftModelError

_NEXTN = {"fc": "nextn.eh_proj.weight", "pre_fc_norm_embedding": "nextn.enorm.weight",
          "pre_fc_norm_hidden": "nextn.hnorm.weight", "norm": "nextn.shared_head_norm.weight"}


class _WithHead:
    """The twin's tensors (all, or `only` those) and the head's, and a config whose block count
    includes the head's block."""

    def __init__(self, twin, head: dict, only: tuple[str, ...] | None = None):
        self.twin, self.head, self.only = twin, head, only
        self.config = copy.copy(twin.config)
        self.config.num_hidden_layers = twin.config.num_hidden_layers + 1

    def state_dict(self):
        model = {k: v for k, v in self.twin.state_dict().items() if self.only is None or k in self.only}
        return {**model, **self.head}


@pytest.fixture(scope="module")
def head_files(tmp_path_factory):
    """(a GGUF file with the MTP head as its last block, a folder holding the same model and head
    in the Hugging Face layout)."""
    root = tmp_path_factory.mktemp("mtp-gguf")
    twin = write_hybrid_gguf("qwen35moe", "F32", root / "plain.gguf")
    n, g = twin.config.num_hidden_layers, torch.Generator().manual_seed(3)
    hidden = twin.config.hidden_size
    full = max(i for i, t in enumerate(twin.config.layer_types) if t == "full_attention")
    layer = {name.replace(f"model.layers.{full}.", f"model.layers.{n}."): t.clone()
             for name, t in twin.state_dict().items() if name.startswith(f"model.layers.{full}.")}
    extras = {f"blk.{n}.{_NEXTN[name]}": (torch.randn(hidden, generator=g) * 0.1).double() for name in _NEXTN}
    extras[f"blk.{n}.{_NEXTN['fc']}"] = torch.randn(hidden, 2 * hidden, generator=g).double() / (2 * hidden) ** 0.5
    head = {**layer, **extras}

    def metadata(writer, config):
        _metadata(writer, config)
        writer.add_nextn_predict_layers(1)

    def layout(name, t):
        return _layout(name, t, twin.config, "qwen35moe", False)

    write_converted(_WithHead(twin, head), root / "mtp.gguf", ARCHES["qwen35moe"], metadata, layout, _value_change,
                    "F32", 0)
    # llama.cpp's --mtp: the head alone, with copies of the embedding, output norm and LM head
    shared = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    write_converted(_WithHead(twin, {k: v.clone() for k, v in head.items()}, shared), root / "mtp-only.gguf",
                    ARCHES["qwen35moe"], metadata, layout, _value_change, "F32", 0)
    folder = root / "hf"
    twin.save_pretrained(folder)  # what the file decodes to, and the head as it decoded
    hf_head = {name.replace(f"model.layers.{n}.", "mtp.layers.0."): t for name, t in head.items()
               if "nextn" not in name}
    hf_head.update({f"mtp.{name}.weight": head[f"blk.{n}.{stored}"] for name, stored in _NEXTN.items()})
    tensors = {**twin.state_dict(), **{k: v.contiguous() for k, v in hf_head.items()}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return root / "mtp.gguf", folder


def _llm(path, **options):
    return lucebox.LLM(path, device="cpu", dtype="float64", prefill_chunk=8, **options)


def test_the_file_s_head_is_the_head_the_hugging_face_layout_holds(head_files):
    file, folder = head_files
    from_file, from_folder = _llm(file), _llm(folder)
    hidden = target_hidden(from_folder, PROMPT)
    assert (target_hidden(from_file, PROMPT) - hidden).abs().max().item() < 1e-5  # the same model (as the twin is)
    heads = [llm.engine.proposer.head for llm in (from_file, from_folder)]
    outs = [head.logits(head_over(head, PROMPT[1:], hidden[:-1])) for head in heads]
    assert (outs[0] - outs[1]).abs().max().item() < 1e-9


def test_greedy_speculation_from_the_file_s_head_is_plain_decoding(head_files):
    file, _ = head_files
    options = {"max_tokens": 32, "ignore_eos": True, "logit_bias": BIASES[1]}
    got = _llm(file, adaptive=False, draft_k=4).generate(PROMPT, **options)
    assert got.stats["drafter"] == "mtp" and got.stats["acceptance_length"] > 1.0
    assert got.token_ids == _llm(file, draft=None).generate(PROMPT, **options).token_ids


def test_the_file_without_its_head_block_loads_as_before(head_files):
    plain = head_files[0].parent / "plain.gguf"
    assert _llm(plain).generate(PROMPT, max_tokens=2).stats["drafter"] is None
    assert gguf.GGUFReader(head_files[0]).fields["qwen35moe.block_count"].parts[-1][0] == 5


def test_an_mtp_only_file_drafts_for_the_model_without_a_head(head_files):
    """llama.cpp's converter with --mtp: the head in a file of its own, given as the drafter."""
    file, folder = head_files
    plain, companion = file.parent / "plain.gguf", file.parent / "mtp-only.gguf"
    llm = _llm(plain, draft=str(companion))
    hidden = target_hidden(llm, PROMPT)
    heads = [llm.engine.proposer.head, _llm(folder).engine.proposer.head]
    outs = [head.logits(head_over(head, PROMPT[1:], hidden[:-1])) for head in heads]
    assert (outs[0] - outs[1]).abs().max().item() < 1e-9
    options = {"max_tokens": 24, "ignore_eos": True, "logit_bias": BIASES[1]}
    got = _llm(plain, draft=str(companion), adaptive=False, draft_k=3).generate(PROMPT, **options)
    assert got.stats["drafter"] == "mtp"
    assert got.token_ids == _llm(plain, draft=None).generate(PROMPT, **options).token_ids
    with pytest.raises(DraftModelError, match="not an MTP-only GGUF file"):
        _llm(plain, draft=str(file))  # a whole model (with its head) is not a drafter here


def test_an_mtp_only_file_of_another_architecture_is_refused_naming_both(head_files, tmp_path):
    companion = head_files[0].parent / "mtp-only.gguf"
    layout = read_layout(companion)
    layout.get("general.architecture").value = "glm4moe"
    other = write_layout(layout, tmp_path / "other-mtp.gguf")
    with pytest.raises(DraftModelError, match="MTP head of a glm4moe model; the target is qwen35moe"):
        _llm(head_files[0].parent / "plain.gguf", draft=str(other))
