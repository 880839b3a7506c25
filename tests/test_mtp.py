"""The model's own MTP head as the drafter (models/mtp.py, speculative/mtp.py): loaded from the
checkpoint by draft='auto', exact as a head (against transformers' own layer), fed the hidden
state of the right position, and lossless in greedy and seeded sampled speculation."""

import pytest
import torch
from conftest import add_mtp_head
from mtp_cases import head_over, target_hidden

import lucebox
from lucebox.caches import Step
from lucebox.errors import DraftModelError, LuceboxWarning
from lucebox.sampling import SamplingParams
from lucebox.speculative.copies_first import CopiesFirst, new_lookup
from lucebox.speculative.proposer import Draft

PROMPT = [5, 9, 17, 33, 2, 64, 100, 7, 7, 21, 90, 3, 44, 18, 120, 6, 75, 31, 12, 58, 99, 4, 27, 81]
# A bias toward a few tokens makes the random target's choices predictable enough that the
# random head's drafts (which the bias reaches too) are kept some of the time, or always.
BIASES = [None, {5: 30.0, 6: 30.0, 7: 30.0}, {11: 40.0}]


def _llm(folder, head_only: bool = False, **options):
    """An engine on `folder`; `head_only`: its MTP head's own drafts, no prompt-lookup copies."""
    llm = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=8, **options)
    if head_only:
        llm.proposer.lookup = None
    return llm


def test_auto_drafts_with_the_checkpoint_s_own_head_and_the_stats_name_it(mtp_folder, reference_models):
    llm = _llm(mtp_folder("qwen3_5_moe"))
    assert llm.generate(PROMPT, max_tokens=4, ignore_eos=True).stats["drafter"] == "mtp"
    assert _llm(mtp_folder("qwen3_5_moe"), draft=None).generate(PROMPT, max_tokens=4).stats["drafter"] is None
    plain = _llm(reference_models("qwen3_5_moe")[0])  # no head: no drafter
    assert plain.generate(PROMPT, max_tokens=4).stats["drafter"] is None
    with pytest.raises(DraftModelError, match=r"draft='mtp'.*no MTP head"):
        _llm(reference_models("qwen3_5_moe")[0], draft="mtp")


def test_repeated_text_is_copied_before_the_head_drafts(mtp_folder):
    """Prompt lookup first, as for DFlash: a tail that occurred before drafts what followed it."""
    proposer = _llm(mtp_folder("qwen3_5_moe")).engine.proposer
    repeating = [3, 4, 5, 6, 7, 8, 3, 4, 5]
    proposer.start(repeating[:-1], None)
    draft = proposer.propose(repeating, 4, SamplingParams(), None, own_k=1)
    assert draft.copied and draft.tokens == [6, 7, 8, 3]  # a copy is as long as asked: its depth is the head's

    class OwnDrafts(CopiesFirst):  # a drafter whose own drafts say how many were asked for
        lookup, max_width = new_lookup(), 15

        def own_draft(self, context, k, params, generator):
            return Draft([0] * k)

    drafter = OwnDrafts()
    drafter.lookup.start(repeating[:-1], None)
    assert drafter.propose(repeating, 4, SamplingParams(), None, own_k=1).tokens == [6, 7, 8, 3]
    assert drafter.propose([1, 2, 3], 4, SamplingParams(), None, own_k=1).tokens == [0]


def test_a_head_config_json_does_not_declare_is_found_by_its_tensors(model_copy):
    """Some Qwen3.6 uploads ship mtp.* without mtp_num_hidden_layers in config.json."""
    folder = model_copy("qwen3_next")
    add_mtp_head(folder, declare=False)
    assert _llm(folder).generate(PROMPT, max_tokens=2).stats["drafter"] == "mtp"


def test_a_head_of_two_layers_is_not_run_and_asking_for_it_says_why(model_copy):
    import json

    folder = model_copy("qwen3_next")
    add_mtp_head(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 2}))
    assert _llm(folder).generate(PROMPT, max_tokens=2).stats["drafter"] is None
    with pytest.raises(DraftModelError, match=r"draft='mtp'.*2 layers \(lucebox runs a one-layer head\)"):
        _llm(folder, draft="mtp")


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("bias", BIASES)
def test_greedy_speculation_with_the_head_is_plain_decoding(name, bias, mtp_folder):
    folder = mtp_folder(name)
    spec = _llm(folder, head_only=True, adaptive=False, draft_k=4)
    plain = _llm(folder, draft=None)
    options = {"max_tokens": 40, "ignore_eos": True, "logit_bias": bias}
    got = spec.generate(PROMPT, **options)
    assert got.token_ids == plain.generate(PROMPT, **options).token_ids
    # Drafts were kept, some (the state rollback after a partial accept ran) or all of them.
    assert got.stats["acceptance_length"] > {None: 0.99, 3: 1.0, 1: 3.0}[bias and len(bias)]


@pytest.mark.parametrize("bias", BIASES[:2])
def test_seeded_sampled_speculation_commits_plain_sampling_s_tokens(bias, mtp_folder):
    folder = mtp_folder("qwen3_5_moe")
    options = {"max_tokens": 40, "ignore_eos": True, "temperature": 0.8, "seed": 11, "logit_bias": bias}
    got = _llm(folder, head_only=True, adaptive=False, draft_k=3).generate(PROMPT, **options)
    assert got.token_ids == _llm(folder, draft=None).generate(PROMPT, **options).token_ids
    assert got.stats["drafter"] == "mtp"


def test_a_chat_turn_that_returns_resumes_the_head_and_stays_exact(mtp_folder):
    folder = mtp_folder("qwen3_5_moe")
    spec, plain = _llm(folder, head_only=True, adaptive=False, draft_k=4), _llm(folder, draft=None)
    options = {"max_tokens": 12, "ignore_eos": True, "logit_bias": BIASES[1]}
    first = spec.generate(PROMPT, **options).token_ids
    again = PROMPT + first + [9, 9, 40]
    got = spec.generate(again, **options)
    assert got.stats["cached_prompt_tokens"] > len(PROMPT)
    assert spec.engine.proposer.rows > 0  # resumed, not started over
    assert got.token_ids == plain.generate(again, **options).token_ids
    # back into rows the head wrote already (a template that drops the thought, a regenerated
    # answer): their states are gone, so the head starts over there; the prompt is still reused
    back = PROMPT + [9, 9, 40, 41, 42]
    got, want = spec.generate(back, **options), plain.generate(back, **options)
    assert got.stats["cached_prompt_tokens"] > len(PROMPT) // 2  # (the recurrent state pinned at PROMPT's end)
    assert got.token_ids == want.token_ids and got.stats["drafter"] == "mtp"
    assert spec.generate(back + got.token_ids + [7], **options).token_ids == plain.generate(
        back + got.token_ids + [7], **options).token_ids


def test_the_head_reads_the_target_state_of_the_position_before_its_token(mtp_folder):
    """Draft 1 comes from the row at last's position - 1: the target's state there and `last`;
    draft 2 from the head's own output and draft 1. Any other pairing (the state of `last`'s own
    position: the off-by-one that costs acceptance silently) gives other drafts and beliefs."""
    llm = _llm(mtp_folder("qwen3_5_moe"))
    proposer = llm.engine.proposer.fork()
    proposer.lookup = None  # the head's own drafts
    context = PROMPT + [42]  # committed + last
    layers = proposer.feature_layers
    proposer.start(PROMPT, None)
    decoder, cache = llm.engine.decoder, llm.engine.new_cache()
    for begin in range(0, len(PROMPT), 5):  # committed in pieces, as prefill chunks and verify steps hand them
        end = min(begin + 5, len(PROMPT))
        _, features = decoder.forward_capturing(torch.tensor(PROMPT[begin:end]),
                                                Step.span(begin, end - begin, torch.device("cpu"), prefill=True),
                                                cache, layers)
        cache.commit(end)
        proposer.commit(PROMPT[:end], end - begin, features)
    draft = proposer.propose(context, 2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))

    hidden = target_hidden(llm, PROMPT)
    out = head_over(proposer.head, context[1:], hidden)  # row t: token t + 1, state t
    second_out = head_over(proposer.head, [*context[1:], draft.tokens[0]], torch.cat([hidden, out[-1:]]))
    shifted = head_over(proposer.head, context[1:], torch.cat([hidden[1:], hidden[-1:]]))  # row t: state t + 1
    expected = [torch.log_softmax(proposer.head.logits(h[-1:])[0], -1) for h in (out, second_out, shifted)]
    drafted = draft.q.log()  # the distributions the two drafts were drawn from
    assert (drafted[0] - expected[0]).abs().max() < 1e-5  # (drawn from float32 probabilities)
    assert (drafted[1] - expected[1]).abs().max() < 1e-5
    assert (drafted[0] - expected[2]).abs().max() > 1e-2


def _offset_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next's RMSNorm: scaled by (1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


@pytest.mark.parametrize("name", ["qwen3_5_moe", "qwen3_next"])
def test_the_head_runs_as_transformers_runs_its_layer(name, mtp_folder, reference_models, exact_reference):
    """The head's math, independently: the pre-fc norms, the embedding first in the concatenation,
    fc, then the checkpoint's layer run by transformers (the test head's layer is a copy of the
    model's last full-attention layer), mtp.norm and the shared LM head."""
    from safetensors.torch import load_file

    folder = mtp_folder(name)
    ref = reference_models(name)[1]
    mtp = {n: t.double() for n, t in load_file(folder / "model.safetensors").items() if n.startswith("mtp.")}
    eps = ref.config.rms_norm_eps
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = ref.model(ids).last_hidden_state[0]  # after the final norm
        embedded = ref.model.embed_tokens(ids[:, 1:])[0]
        x = torch.cat([_offset_norm(embedded, mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                       _offset_norm(hidden[:-1], mtp["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
        x = (x @ mtp["mtp.fc.weight"].T)[None]
        positions = torch.arange(x.shape[1])[None]
        full = max(i for i, t in enumerate(ref.config.layer_types) if t == "full_attention")
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out = ref.model.layers[full](x, attention_mask=causal, position_ids=positions,
                                     position_embeddings=ref.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        expected = ref.lm_head(_offset_norm(out[0], mtp["mtp.norm.weight"], eps))
        llm = _llm(folder)
        head = llm.engine.proposer.head
        got = head.logits(head_over(head, PROMPT[1:], target_hidden(llm, PROMPT)[:-1]))
    assert (got - expected).abs().max().item() <= 1e-6  # as the models' own logits compare


def test_the_memory_plan_counts_the_head_s_weights_and_ring(mtp_folder):
    llm = lucebox.LLM(mtp_folder("qwen3_5_moe"), device="cpu", dtype="float32", max_context=512, prefill_chunk=64,
                      draft_ctx=300)
    planned = llm.memory()["drafter"]
    assert planned > 0
    llm.generate(PROMPT * 3, max_tokens=8, ignore_eos=True)
    assert llm.memory()["drafter"] == planned


def test_an_image_text_checkpoint_s_head_drafts_too(tmp_path):
    """The published Qwen3.5 checkpoints: the text model under model.language_model.*, the head
    under mtp.* and config.json's mtp_num_hidden_layers in text_config."""
    from tiny_models import build_image_text

    build_image_text("qwen3_5_moe").save_pretrained(tmp_path)
    add_mtp_head(tmp_path)
    with pytest.warns(LuceboxWarning, match="vision tower"):
        spec = _llm(tmp_path, head_only=True, adaptive=False, draft_k=3)
        plain = _llm(tmp_path, draft=None)
    options = {"max_tokens": 24, "ignore_eos": True, "logit_bias": BIASES[2]}
    got = spec.generate(PROMPT, **options)
    assert got.stats["drafter"] == "mtp" and got.stats["acceptance_length"] > 2
    assert got.token_ids == plain.generate(PROMPT, **options).token_ids


def test_a_quantized_target_s_head_is_quantized_too(mtp_folder):
    from lucebox.kernels.quant import QuantizedTensor

    folder = mtp_folder("qwen3_5_moe")
    options = {"max_tokens": 20, "ignore_eos": True, "logit_bias": BIASES[1]}
    spec = lucebox.LLM(folder, device="cpu", dtype="float32", quantization="int8", adaptive=False, draft_k=3)
    plain = lucebox.LLM(folder, device="cpu", dtype="float32", quantization="int8", draft=None)
    head = spec.proposer.head
    assert isinstance(head.layer.w["layers.0.experts_gate_up"], QuantizedTensor)
    planned = spec.memory()["drafter"]
    assert spec.generate(PROMPT, **options).token_ids == plain.generate(PROMPT, **options).token_ids
    assert spec.memory()["drafter"] == planned  # the plan counted the head as it is held


def test_a_head_that_does_not_fit_is_left_out_by_auto_and_refused_when_asked_for(mtp_folder, monkeypatch):
    from lucebox.engine import setup
    from lucebox.errors import InsufficientMemoryError

    def without_room_for_a_drafter(*args, **kwargs):
        if args[5].total:  # the drafter's cost
            raise InsufficientMemoryError("no room for the drafter")
        return real(*args, **kwargs)

    real = setup.check_fits
    monkeypatch.setattr(setup, "check_fits", without_room_for_a_drafter)
    with pytest.warns(LuceboxWarning, match="MTP head does not fit"):
        llm = _llm(mtp_folder("qwen3_5_moe"))
    assert llm.generate(PROMPT, max_tokens=2).stats["drafter"] is None
    with pytest.raises(InsufficientMemoryError):
        _llm(mtp_folder("qwen3_5_moe"), draft="mtp")
    real_plan = setup.plan_vram

    def no_room_under_the_budget(*args):
        if args[6] is not None:  # the drafter
            raise InsufficientMemoryError("no room for the drafter under the budget")
        return real_plan(*args)

    monkeypatch.setattr(setup, "plan_vram", no_room_under_the_budget)
    with pytest.warns(LuceboxWarning, match="MTP head does not fit"):
        assert _llm(mtp_folder("qwen3_5_moe"), vram_budget="1GiB").proposer is None


def test_an_incomplete_head_is_left_out_by_auto_and_named_when_asked_for(model_copy):
    """An upload that dropped some of the head's tensors: the model still loads by default."""
    from conftest import rewrite_weights

    from lucebox.errors import MissingTensorError

    folder = model_copy("qwen3_5_moe")
    add_mtp_head(folder)
    rewrite_weights(folder, lambda t: t.pop("mtp.norm.weight"))
    with pytest.warns(LuceboxWarning, match=r"MTP head is incomplete .*mtp\.norm\.weight"):
        assert _llm(folder).generate(PROMPT, max_tokens=2).stats["drafter"] is None
    with pytest.raises(MissingTensorError, match=r"mtp\.norm\.weight"):
        _llm(folder, draft="mtp")
