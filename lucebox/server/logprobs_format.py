"""Log-probabilities on the OpenAI API: the request fields checked into `LLM.stream(logprobs=k)`,
and the engine's `TokenLogprob`s in the two response shapes.

Chat: `logprobs: true` and `top_logprobs: 0..20` give `choices[i].logprobs.content`, one
{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]} per token. Legacy
completions: `logprobs: 0..5` gives {"tokens", "token_logprobs", "top_logprobs" (one dict token ->
logprob per token), "text_offset"}. Both stream too, each event carrying its own tokens'. A token's
text is what that one id adds to a text (a piece of a multi-byte character decodes to U+FFFD, and
its "bytes" are those of that text); without a tokenizer it is "token_id:<id>".
"""

from __future__ import annotations

from lucebox.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from lucebox.server.api_errors import invalid

MAX_LEGACY_LOGPROBS = 5  # the completions API's limit


def logprobs_field(body: dict, kind: str) -> int | None:
    """How many likeliest tokens to report beside each token (`LLM.stream`'s `logprobs`), or None."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if top is not None:
            raise invalid("top_logprobs", "is a chat completions field; completions take logprobs: 0..5")
        if logprobs is None:
            return None
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LEGACY_LOGPROBS:
            raise invalid("logprobs", f"must be an integer in 0..{MAX_LEGACY_LOGPROBS}, got {logprobs!r}")
        if body.get("echo"):
            raise invalid("logprobs", "the prompt's logprobs (echo with logprobs) are not supported")
        return logprobs
    if logprobs is not None and not isinstance(logprobs, bool):
        raise invalid("logprobs", f"must be true or false, got {logprobs!r}")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs", f"must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top!r}")
        if top and not logprobs:  # 0 asks for nothing: accepted without logprobs, as before
            raise invalid("top_logprobs", "needs logprobs: true")
    return (top or 0) if logprobs else None


class TokenText:
    """Each token id's text, decoded once (a response names the same tokens again and again). A
    token is decoded behind an anchor token and the anchor's text cut off, since decoders drop a
    leading space at the start of a text (sentencepiece, a tokenizer.json `Strip`) that a token in
    the middle of one keeps."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}
        if tokenizer is not None:
            self.anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
            self.anchor_text = tokenizer.decode(self.anchor, skip_special_tokens=False)

    def __call__(self, token_id: int) -> str:
        if token_id not in self.known:
            self.known[token_id] = f"token_id:{token_id}" if self.tokenizer is None else self._decode(token_id)
        return self.known[token_id]

    def _decode(self, token_id: int) -> str:
        both = self.tokenizer.decode([*self.anchor, token_id], skip_special_tokens=False)
        if self.anchor and both.startswith(self.anchor_text):
            return both[len(self.anchor_text):]
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: list[TokenLogprob], text: TokenText) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], text: TokenText, offset: int) -> dict:
    """`offset`: where the first token's text starts in the choice's text (what earlier events sent)."""
    tokens = [text(e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(i): v for i, v in e.top} for e in entries], "text_offset": offsets}


def logprobs_json(kind: str, entries: list[TokenLogprob], text: TokenText, offset: int = 0) -> dict:
    """A choice's (or a stream event's) `logprobs` object for these tokens."""
    return chat_logprobs(entries, text) if kind == "chat" else completion_logprobs(entries, text, offset)
