"""Prefix reuse on a hybrid (Gated DeltaNet + full attention): a recurrent state returns only to
positions it kept, so the engine pins states at a chat's turn boundary and at a prompt's
second-to-last position. A new turn then prefills only its own tokens, even when the template
rewrites the previous answer, and answers exactly as a fresh engine does."""

import pytest
import torch
from conftest import with_tokenizer
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.caches.recurrent import SNAPSHOTS, RecurrentState
from lucebox.chat.conversation import encode_all, render
from lucebox.config import LinearAttentionSpec
from lucebox.errors import InvalidArgumentError

ENGINE = dict(device="cpu", dtype="float64", max_context=512, prefill_chunk=16, draft="ngram", adaptive=False)
# Past answers are rendered without the "thinking." the generation prompt opens them with (as
# templates that drop past reasoning do), so a new turn shares the old one only up to the boundary.
REWRITING = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
             "{% if add_generation_prompt %}<s>assistant: thinking.{% endif %}")
PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def hybrid(reference_models):
    return reference_models("qwen3_next")[0]


@pytest.fixture(scope="module")
def chat_folder(hybrid, tmp_path_factory):
    return with_tokenizer(hybrid, tmp_path_factory.mktemp("hybrid_chat"), REWRITING)


def fresh(folder, ids, **options):
    return lucebox.LLM(folder, **ENGINE).generate(ids, temperature=0.0, **options)


def test_a_second_turn_prefills_from_the_turn_boundary_and_answers_as_a_fresh_engine(chat_folder):
    llm = lucebox.LLM(chat_folder, **ENGINE)
    chat = llm.chat(temperature=0.0, max_tokens=10)
    first = chat.send("hello world, this is a tiny corpus.")
    boundary = len(encode_all(llm.tokenizer, render(llm.tokenizer, chat.history[:1], add_generation_prompt=False)))
    second = chat.send("the quick brown fox")
    assert first.token_ids and chat.last_prompt_ids[boundary:boundary + 1] != first.token_ids[:1]
    # the template rewrote the first answer, so the prompts part at the turn boundary: reused up to it
    assert 0 < boundary == second.stats["cached_prompt_tokens"]
    assert second.token_ids == fresh(chat_folder, chat.last_prompt_ids, max_tokens=10).token_ids


def test_a_retried_prompt_reuses_all_but_its_last_token(hybrid):
    llm = lucebox.LLM(hybrid, **ENGINE)
    first = llm.generate(PROMPT, max_tokens=12, ignore_eos=True)
    again = llm.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert again.stats["cached_prompt_tokens"] == len(PROMPT) - 1
    assert again.token_ids == first.token_ids == fresh(hybrid, PROMPT, max_tokens=12, ignore_eos=True).token_ids


def test_pins_survive_commits_and_verify_steps_and_only_the_newest_are_kept(hybrid):
    llm = lucebox.LLM(hybrid, **ENGINE)
    llm.generate(PROMPT, max_tokens=20, ignore_eos=True, snapshot_at=[10, 25])
    states = [layer for layer in llm.session.cache.layers if isinstance(layer, RecurrentState)]
    assert states and all(sorted(s.pinned) == [25, len(PROMPT) - 1][-SNAPSHOTS:] for s in states)
    assert llm.session.cache.rewind_point(30) == 25 and llm.session.cache.rewind_point(24) == 0
    # a prompt that leaves the first at position 30 restarts from the pin at 25
    other = PROMPT[:30] + [(t + 1) % VOCAB for t in PROMPT[30:]]
    out = llm.generate(other, max_tokens=12, ignore_eos=True)
    assert out.stats["cached_prompt_tokens"] == 25
    assert out.token_ids == fresh(hybrid, other, max_tokens=12, ignore_eos=True).token_ids
    with pytest.raises(InvalidArgumentError, match="snapshot_at"):
        llm.generate(PROMPT, max_tokens=2, snapshot_at=[len(PROMPT) + 1])
    with pytest.raises(InvalidArgumentError, match="snapshot_at"):
        llm.generate(PROMPT, max_tokens=2, snapshot_at=5)


def test_a_pinned_state_outlives_the_ring_slots_later_steps_overwrite():
    """Verify steps wrap around the ring of state slots many times over; a pinned state comes back
    as it was."""
    spec = LinearAttentionSpec(key_heads=1, value_heads=2, key_dim=4, value_dim=4, conv_kernel=4)
    state = RecurrentState(spec, decode_rows=4, dtype=torch.float64, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)

    def step(start: int, rows: int, prefill: bool = False):
        span = Step.span(start, rows, torch.device("cpu"), prefill=prefill)
        state.reserve(span)
        n = 1 if prefill else rows
        after = [torch.randn(n, *t.shape[1:], generator=gen, dtype=t.dtype) for t in (state.conv, state.recurrent)]
        state.step_state(span.positions, prefill).update(*after)
        return [t[-1] for t in after]

    pinned = step(0, 10, prefill=True)
    state.pin(10)
    for start in range(10, 30, 4):  # every draft kept: 20 states through a ring of 5 slots
        step(start, 4)
    assert 10 not in state.held
    state.rollback(10)
    now = state.step_state(torch.tensor([10]), prefill=False).current()
    assert all(torch.equal(a, b) for a, b in zip(now, pinned, strict=True))
