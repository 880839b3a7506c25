"""A conversation as the model sees it: messages rendered by the chat template (or the plain
template), and a token context that only grows from one request to the next.

The context is not re-tokenized each turn. A turn appends the text the template adds after what is
already held (the template rendered now minus the template rendered before, as llama.cpp's chat
does), tokenized as a continuation; an answer adds the tokens the model generated, exactly as it
generated them, then the template's closing text (e.g. `<|im_end|>\\n`) unless the model wrote it
itself. So the engine's prefix reuse covers everything before the new turn. A template that
rewrites earlier turns (some drop past reasoning) breaks that prefix: the conversation is then
tokenized again, and the engine still reuses the longest prefix of tokens it shares with what it holds.

A model without a chat template (the built-in code model) gets the plain template: the conversation
is one document (each user or system message on a line of its own, each answer continuing the
text), so a completion model continues it.
"""

from __future__ import annotations

from collections.abc import Callable

_MARKER = "\x00lucebox-answer\x00"  # stands in for an answer to find where the template puts it


_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")  # what templates read


def render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
           variables: dict | None = None) -> str:
    """The prompt text of `messages` ({"role", "content"} dicts, and a tool-calling chat's
    `tool_calls`, `tool_call_id`, `name`, an answer's `reasoning_content`); `tools` go to the template as
    transformers passes them; `variables`: the template's own switches (`enable_thinking`, ...)."""
    messages = [{k: m[k] for k in _MESSAGE_KEYS if k in m} for m in messages]
    if tokenizer.has_chat_template:
        extra = {**(variables or {}), **({} if tools is None else {"tools": tools})}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    text = ""
    for m in messages:  # a user's message starts on a line of its own; an answer continues the text
        newline = m["role"] != "assistant" and text and not text.endswith("\n")
        text += "\n" * bool(newline) + (m["content"] or "")  # an answer that only called tools has none
    return text


def turn_boundary(history_ids: list[int], prompt_ids: list[int]) -> tuple[int, ...]:
    """`LLM.stream`'s `snapshot_at` for a chat turn: where the template's generation prompt starts
    in `prompt_ids` (the end of the conversation so far, `history_ids`), which the next turn shares
    even when the template rewrites this turn's answer; none when `history_ids` is not a prefix."""
    n = len(history_ids)
    return (n,) if 0 < n < len(prompt_ids) and prompt_ids[:n] == history_ids else ()


def encode_all(tokenizer, text: str) -> list[int]:
    """Token ids of a whole rendered conversation: a template writes its own BOS; the plain template
    is a document that starts with one."""
    return tokenizer.encode(text, add_special_tokens=not tokenizer.has_chat_template)


class GrowingContext:
    """The token ids that stand for a rendered conversation; see the module docstring."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] | None = None  # stands for `rendered`; None: tokenize the next prompt whole
        self.rendered = ""

    def reset(self, ids: list[int] | None = None, rendered: str = "") -> None:
        self.ids, self.rendered = ids, rendered

    def prompt_ids(self, prompt_text: str) -> list[int]:
        """Ids of a rendered prompt: what is held plus the new text, or the whole text tokenized."""
        if self.ids is not None and prompt_text.startswith(self.rendered):
            return self.ids + self.tokenizer.encode_continuation(prompt_text[len(self.rendered):])
        return encode_all(self.tokenizer, prompt_text)

    def record(self, prompt_text: str, prompt_ids: list[int], generated: list[int], answer: str, ended: str,
               render_with: Callable[[str], str]) -> None:
        """After an answer. `ended`: "token" (EOS or a stop token, which is in `generated`), "string" (a
        stop string: the generated tokens hold text the answer does not), or "length"/"cut".
        `render_with(content)` renders the conversation with `content` as the answer."""
        if ended == "string":
            self.reset()  # the next prompt is tokenized whole; the engine still reuses the shared prefix
            return
        # Where the template puts an answer, and what closes the turn, from a rendering with a marker
        # in the answer's place. What it puts before the answer that the prompt lacked (some add a space
        # after "assistant:") is left out: the model's own tokens stand.
        marked, rendered = render_with(_MARKER), render_with(answer)
        if not marked.startswith(prompt_text) or _MARKER not in marked:
            self.reset()  # the template rewrote earlier turns: tokenize it all next time
            return
        before, closing = marked[len(prompt_text):].split(_MARKER, 1)
        if rendered != prompt_text + before + answer + closing:
            self.reset()  # the template changes the answer's text: tokenize it all next time
            return
        if generated and ended == "token":
            written = self.tokenizer.decode(generated[-1:], skip_special_tokens=False)
            if written and closing.startswith(written):
                closing = closing[len(written):]  # the model wrote the template's end marker itself
        self.reset(prompt_ids + generated + self.tokenizer.encode_continuation(closing), rendered)
