"""The text stage of a request: committed token ids in, the chunks a caller sees out.

Contract: `feed(tokens)` takes one round's committed tokens in order and returns the chunk to
yield (token ids, and their text when the model has a tokenizer); it stops at the first token
that ends the request (EOS or a stop token, emitted; a stop string, never emitted; a tool call
repeated, emitted; or `max_tokens`), after which `finish` is set and tokens past it are not counted;
a thought that spends its budget ends the round the same way, without ending the request. `last(stats)` is
the final chunk: the ids and text of the round that finished, any text held back for a stop
string that never came, finish_reason and stats. Device values are never read here.
"""

from __future__ import annotations

from lucebox.generation import Chunk
from lucebox.text.call_watch import RepeatedCallWatch
from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.stopping import StopStrings
from lucebox.text.thought_budget import ThoughtBudget


class TextStage:
    def __init__(self, tokenizer, prompt_ids: list[int], stop_strings: list[str], stop_ids: set[int],
                 max_tokens: int, call_syntax: str | None = None, thought: tuple[str | None, bool] = (None, False),
                 thought_budget: int | None = None):
        """`call_syntax`: end the answer where it repeats a tool call written in that syntax, after the
        answer's thought (`thought`: a reasoning syntax, whether the prompt opened it). `thought_budget`:
        a round ends at the token that spends it (`thought_spent`: the close is due)."""
        self.text = IncrementalDecoder(tokenizer, prompt_ids) if tokenizer is not None else None
        self.calls = RepeatedCallWatch(tokenizer, call_syntax, prompt_ids, *thought) if (
            call_syntax is not None and tokenizer is not None) else None
        self.thought = ThoughtBudget(tokenizer, prompt_ids, *thought, thought_budget) if (
            thought_budget is not None and thought[0] is not None and tokenizer is not None) else None
        self.stops = StopStrings(stop_strings)
        self.stop_ids, self.max_tokens = stop_ids, max_tokens
        self.generated: list[int] = []
        self.finish: str | None = None
        self._by_stop_string = False
        self._held = Chunk([], None)  # the chunk of the round that finished the request

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)

    def feed(self, tokens: list[int]) -> Chunk:
        new_ids, new_text = [], "" if self.text is not None else None
        for token in tokens:
            self.generated.append(token)
            new_ids.append(token)
            if self.text is not None:
                piece, self._by_stop_string = self.stops.feed(self.text.push([token]))
                new_text += piece
            repeated = self.calls is not None and self.calls.push([token])
            if self._by_stop_string or token in self.stop_ids or repeated:
                self.finish = "stop"
            elif len(self.generated) >= self.max_tokens:
                self.finish = "length"
            if self.finish is not None:
                break
            if self.thought is not None and self.thought.push(token):
                break  # the thought's budget is spent: nothing past this token; the close comes next
        chunk = Chunk(new_ids, new_text)
        if self.finish is not None:
            self._held = chunk
        return chunk

    def last(self, stats: dict) -> Chunk:
        ids, text = self._held.token_ids, self._held.text
        if self.text is not None and not self._by_stop_string:
            text += self.stops.feed(self.text.flush())[0] + self.stops.flush()
        return Chunk(ids, text, self.finish, stats, self._held.logprobs)


def timing_stats(prompt_len: int, reused: int, n: int, start: float, prefill_done: float, end: float) -> dict:
    """A request's token counts and speeds; decode time runs from the first token to the end."""
    prefill_s = max(prefill_done - start, 1e-9)
    decode_s = max(end - prefill_done, 1e-9)
    return {
        "prompt_tokens": prompt_len,
        "cached_prompt_tokens": reused,  # rows reused from the previous request: not prefilled again
        "generated_tokens": n,
        "prefill_time_s": prefill_s,
        "decode_time_s": decode_s,
        "prefill_tokens_per_s": (prompt_len - reused) / prefill_s,
        # The first token comes from the prefill's logits; decode speed counts the rest.
        "decode_tokens_per_s": (n - 1) / decode_s if n > 1 else 0.0,
        "tokens_per_s": n / max(end - start, 1e-9),
    }
