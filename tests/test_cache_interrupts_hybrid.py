"""A KeyboardInterrupt at any line of the recurrent state cache, or of the sequence cache's pinning
and rewinding, leaves a hybrid (Gated DeltaNet + full attention) engine as good as a fresh one.

Request 2 returns to a state pinned at request 1's turn boundary, pins its own, then drafts,
verifies, commits and rolls back with per-row state slots; interrupted anywhere in that, request 3
(which returns to request 2's pinned snapshot) gives a fresh engine's greedy tokens. Named to run
before tests/test_hardening.py (see tests/test_cache_interrupts.py)."""

import random

import pytest
import torch
from line_interrupts import Scenario
from tiny_models import VOCAB

import lucebox
from lucebox.caches import recurrent, sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: faster on one thread

ENGINE = dict(device="cpu", dtype="float64", max_context=256, prefill_chunk=16, draft="ngram", adaptive=False)
_gen = torch.Generator().manual_seed(3)
FIRST = (torch.randint(0, VOCAB, (6,), generator=_gen).tolist() * 7)[:40]  # repeats: n-gram drafts get accepted
SECOND = FIRST[:34] + torch.randint(0, VOCAB, (20,), generator=_gen).tolist()  # shares FIRST up to its pin at 30
# Leaves SECOND just after its turn boundary at 50, which request 2's 24 answer tokens have since pushed out
# of the ring of state slots: it starts from the pinned snapshot.
THIRD = SECOND[:52] + torch.randint(0, VOCAB, (6,), generator=_gen).tolist()


class PinnedScenario(Scenario):
    """Also checks, after request 3, every pinned snapshot against a fresh prefill of the tokens
    before it: a snapshot an interrupt left wrong would only show in a later request."""

    def kept_state_error(self, llm: lucebox.LLM) -> str | None:
        fresh = lucebox.LLM(self.folder, **self.engine).engine
        tokens = llm.session.tokens
        for i, layer in enumerate(llm.session.cache.layers):
            for position, slot in getattr(layer, "pinned", {}).items():
                cache = fresh.new_cache()
                for _ in fresh.prefill(tokens[:position], cache):
                    pass
                want = cache.layers[i].step_state(torch.tensor([position]), prefill=False).current()
                got = (layer.conv[slot], layer.recurrent[slot])
                if any((a - b).abs().max() > 1e-9 for a, b in zip(got, want, strict=True)):
                    return f"layer {i}'s snapshot at {position} is not the state of its tokens"
        return None


@pytest.fixture(scope="module")
def scenario(reference_models):
    folder, _ = reference_models("qwen3_next")
    return PinnedScenario(folder, ENGINE, (FIRST, {"max_tokens": 8, "snapshot_at": [30]}),
                    (SECOND, {"max_tokens": 24, "snapshot_at": [50]}), (THIRD, {"max_tokens": 8}))


def state_cache_lines(counts) -> list:
    """Executed lines of lucebox/caches/recurrent.py, and of the sequence cache's rewind_point and pin."""
    functions = (sequence.SequenceCache.rewind_point, sequence.SequenceCache.pin)
    extra = {(f.__code__.co_filename, line) for f in functions for _, _, line in f.__code__.co_lines()}
    return sorted(line for line in counts if line[0] == recurrent.__file__ or line in extra)


def test_interrupt_at_any_line_of_the_state_cache_then_the_next_request_matches_a_fresh_engine(scenario):
    lines = state_cache_lines(scenario.counts)
    assert len(lines) > 30
    r = random.Random(0)  # each line at its first execution and a seeded one among request 2's (0.3 s each)
    wrong = [w for line in lines for nth in sorted({1, r.randint(1, scenario.counts[line])})
             if (w := scenario.check(line, nth))]
    assert not wrong, f"of {len(lines)} lines, wrong after: {wrong}"
