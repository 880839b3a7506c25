"""A reasoning model's answer under a constraint (`constrained.thought_first`), checked token by token
by the grammar engine: the thought stays free and the answer after it follows the constraint. For
gpt-oss (harmony: `harmony_first_grammar`) the analysis message is the thought and the final message
the answer, whether the vocabulary holds the channel markers as special tokens (gpt-oss's) or spells
them as text; for `<think>`, a close spelled as text ends the thought for these token checks too
(which the speculative rounds run on drafts): the thought is a lazy lexeme with the close as its
`suffix`, since one with `stop=` hides its stop from them and they refuse the answer after it."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import lucebox
from lucebox.builtin import builtin_model
from lucebox.constrained.spec import Constraint
from lucebox.constrained.state import GrammarState
from lucebox.constrained.thought_first import answer_rule, thought_first_grammar, thought_first_options
from lucebox.request_options import RequestOptions
from lucebox.text.tokenizer_files import load_tokenizer

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
PROMPT = "<|start|>user<|message|>Is it ok?<|end|><|start|>assistant"
THOUGHT = "<|channel|>analysis<|message|>let me think about it<|end|><|start|>assistant"
FINAL = '<|channel|>final<|message|>{"ok":true}'


def _harmony_vocabulary(folder):
    """A byte-level BPE vocabulary with the harmony markers as special tokens, as gpt-oss's."""
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = ['{"ok":true}', "let me think about it, is it ok?", "analysis final assistant user"]
    tok.train_from_iterator(corpus * 10, trainers.BpeTrainer(vocab_size=400, special_tokens=MARKERS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>"}))
    return load_tokenizer(folder, {}, None)


@pytest.fixture(scope="module", params=["special", "text"])
def vocabulary(request, tmp_path_factory):
    if request.param == "special":
        tokenizer = _harmony_vocabulary(tmp_path_factory.mktemp("harmony") / "vocab")
        assert all(tokenizer.encode_continuation(m) == [tokenizer.token_to_id(m)] for m in MARKERS)
        return tokenizer
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    assert tokenizer.token_to_id("<|channel|>") is None  # spelled as text
    return tokenizer


def _accepted(tokenizer, prompt: str, answer: str, fmt: str = "harmony") -> bool:
    """Whether the constrained answer after `prompt` may be `answer`, then end."""
    options = RequestOptions.from_keywords(max_tokens=64, json_schema=SCHEMA)
    fields = thought_first_options(fmt, prompt, options, None, None, tokenizer.token_to_id)
    assert fields["json_schema"] is None  # the schema is now the answer's, inside the grammar
    return _follows(fields["grammar"], tokenizer, answer)


def _follows(grammar: str, tokenizer, text: str) -> bool:
    eos = tokenizer.token_to_id("<|return|>") or 2  # (2: the built-in vocabulary's </s>)
    state = GrammarState(Constraint.lark(grammar, "grammar"), tokenizer, tokenizer.vocab_size, (eos,),
                         torch.device("cpu"))
    ids = tokenizer.encode_continuation(text) + [eos]
    return state.matcher.validate_tokens(ids) == len(ids)


def test_the_analysis_stays_free_and_the_final_message_follows_the_constraint(vocabulary):
    assert _accepted(vocabulary, PROMPT, THOUGHT + FINAL)
    assert _accepted(vocabulary, PROMPT, FINAL)  # straight to the final message
    assert _accepted(vocabulary, PROMPT + "<|channel|>analysis<|message|>",  # the prompt opened the thought
                     THOUGHT.removeprefix("<|channel|>analysis<|message|>") + FINAL)
    assert not _accepted(vocabulary, PROMPT, '{"ok":true}')  # no channel: not a harmony answer
    assert not _accepted(vocabulary, PROMPT, THOUGHT + '<|channel|>final<|message|>{"ok":1}')  # off the schema
    assert not _accepted(vocabulary, PROMPT, THOUGHT)  # the thought alone: no answer
    assert answer_rule(SCHEMA) in thought_first_options("harmony", PROMPT, RequestOptions.from_keywords(
        max_tokens=64, json_schema=SCHEMA), None, None, vocabulary.token_to_id)["grammar"]


def test_a_request_s_own_grammar_or_no_constraint_is_left_as_it_is():
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    for grammar in (None, 'start: "x"'):
        options = RequestOptions.from_keywords(max_tokens=8, grammar=grammar)
        assert thought_first_options("harmony", PROMPT, options, None, None, tokenizer.token_to_id) == {}


def test_a_think_close_spelled_as_text_ends_the_thought_for_token_checks_too():
    tokenizer = load_tokenizer(builtin_model(), {}, None)
    answer = '<think>\nhm, let me see.\n</think>\n\n{"ok":true}'
    assert _accepted(tokenizer, "<|im_start|>assistant\n", answer, "think")
    assert _accepted(tokenizer, "<|im_start|>assistant\n<think>\n", "hm.</think>{\"ok\":false}", "think")
    assert not _accepted(tokenizer, "<|im_start|>assistant\n", '<think>x</think>>{"ok":true}', "think")
    bounded = thought_first_grammar(False, 0, answer_rule(SCHEMA))  # closed at once
    assert _follows(bounded, tokenizer, '<think></think>{"ok":true}')


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}], ids=["greedy", "seeded"])
def test_speculation_under_a_thought_first_grammar_commits_plain_decoding_s_tokens(builtin_llm, sampling):
    """The built-in model writes "yield" early: a close it reaches, with the schema's answer after it."""
    grammar = thought_first_grammar(True, None, answer_rule(SCHEMA), markers=("<think>", "yield"))
    options = {"max_tokens": 40, "grammar": grammar, **sampling}
    got = builtin_llm.generate("def f(x):", **options)
    assert got.token_ids == lucebox.LLM(draft=None).generate("def f(x):", **options).token_ids
    assert got.stats["acceptance_length"] > 1
    if not sampling.get("seed"):  # (greedy reaches the close well within its tokens)
        assert json.loads(got.text.partition("yield")[2]) in ({"ok": True}, {"ok": False})
