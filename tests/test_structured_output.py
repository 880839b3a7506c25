"""Constrained output (`lucebox.constrained`) on the built-in code model, which never writes JSON on
its own: every schema's output parses and validates, greedy and sampled; speculation (the DFlash
drafter, the n-gram drafter) changes no greedy token; what the grammar engine cannot compile is a
GrammarError naming the argument, raised before the engine runs."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from conftest import CORPUS
from structured_schemas import SCHEMAS
from tiny_models import VOCAB
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import lucebox
from lucebox.constrained import Constraint, GrammarState
from lucebox.errors import GrammarError, LuceboxError, TokenizerError
from lucebox.server.api_errors import mid_output_error
from lucebox.speculative.proposer import Draft

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "# data\nx = "


def _valid(generation, schema) -> None:
    assert generation.finish_reason == "stop", generation.text
    jsonschema.validate(json.loads(generation.text), schema)


def _drafted(generation) -> int:
    return sum(k * n for k, n in generation.stats["width_histogram"].items())


def test_every_schema_gives_valid_json_greedy_and_sampled_and_speculation_changes_no_greedy_token():
    assert len(SCHEMAS) >= 20
    llm = lucebox.LLM(adaptive=False)  # the DFlash drafter drafts every round, however few drafts it gets kept
    drafted = 0
    for i, schema in enumerate(SCHEMAS):
        greedy = llm.generate(PROMPT, max_tokens=48, json_schema=schema)
        _valid(greedy, schema)
        drafted += _drafted(greedy)
        plain = llm.generate(PROMPT, max_tokens=48, json_schema=json.dumps(schema), speculate=False)
        assert plain.token_ids == greedy.token_ids, schema
        _valid(llm.generate(PROMPT, max_tokens=48, json_schema=schema, temperature=1.0, seed=i), schema)
    assert drafted > 0  # the drafter's tokens were verified under the grammar


def test_the_ngram_drafter_under_a_grammar_is_lossless():
    llm = lucebox.LLM(draft="ngram")
    drafted = 0
    for schema in SCHEMAS[10:16]:
        # A prompt holding earlier JSON: prompt lookup drafts copies of it, some the grammar forbids.
        prompt = 'a = {"point":{"x":10,"y":10}}\nb = {"user":{"name":"x","role":"admin"}}\nc = '
        spec = llm.generate(prompt, max_tokens=48, json_schema=schema)
        _valid(spec, schema)
        drafted += _drafted(spec)
        assert llm.generate(prompt, max_tokens=48, json_schema=schema, speculate=False).token_ids == spec.token_ids
    assert drafted > 0


def test_json_mode_and_a_lark_grammar_and_the_chat_session(builtin_llm):
    answer = builtin_llm.generate(PROMPT, max_tokens=32, json_object=True)
    assert answer.finish_reason == "stop" and isinstance(json.loads(answer.text), dict)
    answer = builtin_llm.generate(PROMPT, max_tokens=16, grammar='start: ("yes" | "no") " " NUM\nNUM: /[0-9]{2}/')
    assert answer.finish_reason == "stop" and answer.text.split()[0] in ("yes", "no") and len(answer.text) == 6
    chat = builtin_llm.chat(max_tokens=32, json_schema=SCHEMAS[3])
    _valid(chat.send("a color"), SCHEMAS[3])
    _valid(chat.send("another", json_schema=SCHEMAS[1]), SCHEMAS[1])


@pytest.mark.parametrize("options, field", [
    ({"grammar": "start: nothing_defined"}, "grammar"),
    ({"grammar": ""}, "grammar"),
    ({"json_schema": {"not": {"type": "string"}}}, "json_schema"),  # a keyword the engine does not implement
    ({"json_schema": {"type": "strnig"}}, "json_schema"),
    ({"json_schema": {"type": "integer", "minimum": "zero"}}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": ["type", "object"]}, "json_schema"),
    ({"json_schema": {"type": "object"}, "grammar": 'start: "a"'}, "grammar"),
    ({"json_object": "yes"}, "json_object"),
    ({"json_object": True, "ignore_eos": True}, "json_object"),
])
def test_constraints_the_engine_cannot_compile_are_refused_before_it_runs(builtin_llm, options, field):
    before = builtin_llm.session.tokens
    with pytest.raises(GrammarError) as refused:
        builtin_llm.stream("x = ", max_tokens=4, **options)
    assert refused.value.field == field and str(refused.value).startswith(field)
    assert builtin_llm.session.tokens is before  # nothing reached the engine


def test_drafts_end_at_the_first_token_the_grammar_forbids_and_sampled_drafts_keep_only_allowed_mass(builtin_llm):
    tokenizer, vocab = builtin_llm.tokenizer, builtin_llm.config.vocab_size
    state = GrammarState(Constraint.lark('start: "yes" | "no"'), tokenizer, vocab, (2,), torch.device("cpu"))
    yes, no = tokenizer.encode_continuation("yes"), tokenizer.encode_continuation("no")
    assert state.cut(Draft(yes + no)).tokens == yes  # after "yes" only EOS is allowed
    assert state.cut(Draft(no + yes)).tokens == no
    assert state.cut(Draft(tokenizer.encode_continuation("maybe"))).tokens == []
    q = torch.full((len(yes), vocab), 1.0 / vocab, dtype=torch.float64)
    logits, draft = state.constrain(torch.zeros(len(yes) + 1, vocab), Draft(yes, q))
    allowed = logits > -1e29
    assert allowed[0, yes[0]] and allowed[0, no[0]] and allowed.sum() < 3 * (len(yes) + 1)
    assert torch.allclose(draft.q.sum(-1), torch.ones(len(yes), dtype=torch.float64))
    assert (draft.q[~allowed[: len(yes)]] == 0).all()
    assert allowed[-1].nonzero().flatten().tolist() == [2]  # "yes" complete: only EOS
    assert state.cut(Draft(yes)).tokens == yes  # constrain rolled its drafts back


def test_a_sampled_draft_cut_or_verified_under_the_grammar_leaves_the_masked_target_distribution(builtin_llm):
    """Speculative sampling (tokenwise) of one draft d ~ q, enumerated: a forbidden d is cut (the
    token then comes from the masked target), an allowed one is verified against the masked target
    with q restricted and renormalized; the token's distribution is the masked target's, exactly."""
    from lucebox.sampling import SamplingParams, distribution
    from lucebox.speculative.verify import tokenwise_outcomes

    tokenizer, vocab = builtin_llm.tokenizer, builtin_llm.config.vocab_size
    state = GrammarState(Constraint.lark('start: "yes" | "no" | "maybe"'), tokenizer, vocab, (2,),
                         torch.device("cpu"))
    allowed = [t[0] for t in map(tokenizer.encode_continuation, ("yes", "no", "maybe"))]
    support = [*allowed, *tokenizer.encode_continuation("def x")]  # q's mass: some allowed, some forbidden
    torch.manual_seed(0)
    logits = torch.randn(2, vocab) * 3
    q = torch.zeros(1, vocab, dtype=torch.float64)
    q[0, support] = torch.rand(len(support), dtype=torch.float64)
    q /= q.sum()
    params, nothing = SamplingParams(temperature=0.7), torch.zeros(vocab, dtype=torch.bool)
    masked, _ = state.constrain(logits[:1], Draft([]))
    target = distribution(masked, params, nothing).double()[0]
    produced = torch.zeros(vocab, dtype=torch.float64)
    cut = 0
    for d in support:
        draft = state.cut(Draft([d], q))
        if not draft.tokens:
            produced += q[0, d] * target
            cut += 1
            continue
        masked, verified = state.constrain(logits, draft)
        outcomes = tokenwise_outcomes(distribution(masked, params, nothing).double(), verified.q, [d])
        produced += q[0, d] * outcomes.accept[0] * outcomes.next_dists[0]
        produced[d] += q[0, d] * outcomes.accept[1]
    assert 0 < cut < len(support) and (target[allowed] > 0).all() and (target > 0).sum() < vocab
    torch.testing.assert_close(produced, target, rtol=0, atol=1e-6)  # p is float32 softmax


def test_a_special_token_s_name_in_a_grammar_literal_is_written_as_text(builtin_llm):
    """A grammar's literal text that names a special token ("</s>", the EOS) is text, spelled with
    ordinary tokens: the grammar engine never lets a special token write text, so tokenizing it to
    the special token made the mask, the forced drafts and the commit disagree (an error mid-output)."""
    grammar = 'start: "</s>" " x = " ("yes" | "no")'
    spec = builtin_llm.generate(PROMPT, max_tokens=24, grammar=grammar)
    assert spec.finish_reason == "stop" and spec.text in ("</s> x = yes", "</s> x = no"), spec.text
    assert spec.token_ids.count(2) == 1  # the EOS that ends it, only
    assert builtin_llm.generate(PROMPT, max_tokens=24, grammar=grammar, speculate=False).token_ids == spec.token_ids
    tokenizer = builtin_llm.tokenizer
    assert tokenizer.encode_continuation("</s>x") != tokenizer.encode_continuation("</s>x", parse_special=False)


def _byte_level_copy(folder: Path, dest: Path) -> Path:
    """The model in `folder` with a byte-level BPE tokenizer.json (GPT-2's kind) that can write JSON,
    and a special token [TOOL_CALLS] (Mistral's)."""
    shutil.copytree(folder, dest)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [*CORPUS, '{"ok": true, "n": 1}', '{"ok": false, "n": [2, 3]}', "[TOOL_CALLS] [x]"] * 5
    special = ["<unk>", "<s>", "</s>", "[TOOL_CALLS]"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special))
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return dest


def test_a_tokenizer_json_vocabulary_is_constrained_too(reference_models, text_model, tmp_path):
    """tokenizer.json (the `tokenizers` backend) reaches llguidance as it is; here a tiny random
    Mistral, which writes nothing sensible unconstrained. A decoder llguidance does not read is a
    TokenizerError before anything runs."""
    llm = lucebox.LLM(_byte_level_copy(reference_models("mistral")[0], tmp_path / "m"), device="cpu",
                      dtype="float32")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(3):
        _valid(llm.generate("hello", max_tokens=32, json_schema=schema, temperature=1.0, seed=seed), schema)
    literal = llm.generate("hello", max_tokens=24, grammar='start: "[TOOL_CALLS]" " [" ("ok" | "n") "]"')
    assert literal.text in ("[TOOL_CALLS] [ok]", "[TOOL_CALLS] [n]"), literal.text
    assert llm.tokenizer.token_to_id("[TOOL_CALLS]") not in literal.token_ids  # spelled as text
    with pytest.raises(TokenizerError, match="llguidance"):  # a bare Metaspace decoder
        text_model.stream("hello", max_tokens=4, json_object=True)


def test_grammar_text_the_vocabulary_cannot_write_is_a_grammar_error_naming_the_field(reference_models, tmp_path):
    """A tokenizer without byte fallback writes text it has no tokens for as an unknown token, which
    the grammar engine must not take as spelling it: the request fails with a GrammarError (the
    server's 400, also once output has begun), never a token the grammar then refuses."""
    llm = lucebox.LLM(_byte_level_copy(reference_models("mistral")[0], tmp_path / "m"), device="cpu",
                      dtype="float32")
    cases = [{"grammar": 'start: "字"'}, {"grammar": 'start: "ok " "字"'},  # no token starts it / goes on after "ok "
             {"json_schema": {"type": "object", "properties": {"c": {"enum": ["字"]}}, "required": ["c"]}}]
    for constraint in cases:
        with pytest.raises(GrammarError, match="vocabulary cannot write") as refused:
            llm.generate("hello", max_tokens=12, **constraint)
        assert refused.value.field == next(iter(constraint))
        answer = mid_output_error(refused.value, SimpleNamespace(tools=None))
        assert answer.status == 400 and answer.param == {"grammar": "grammar", "json_schema":
                                                         "response_format.json_schema.schema"}[refused.value.field]
    assert mid_output_error(LuceboxError("x"), SimpleNamespace(tools=None)).status == 500
