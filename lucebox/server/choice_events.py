"""The stream events of one choice of a request (`server.choices`): each names its choice's
`index` and carries its tokens' logprobs when the request asked for them."""

from __future__ import annotations

from lucebox.server import openai_api as api
from lucebox.server.logprobs_format import TokenText, logprobs_json


class ChoiceEvents:
    """The stream events of one choice: its `index`, and its tokens' logprobs when asked for."""

    def __init__(self, req, rid: str, model: str, index: int, token_text: TokenText):
        self.req, self.rid, self.model, self.index, self.token_text = req, rid, model, index, token_text
        self.offset = 0  # text sent so far: where the next completions event's text_offset starts

    def event(self, text: str | None, finish: str | None, logprobs=None, first: bool = False) -> dict:
        event = api.chunk(self.req, self.rid, self.model, text, finish, first)
        event["choices"][0]["index"] = self.index
        if logprobs is not None and self.req.options.logprobs is not None:
            event["choices"][0]["logprobs"] = logprobs_json(self.req.kind, logprobs, self.token_text, self.offset)
        self.offset += len(text or "")
        return event
