"""A multi-turn conversation over one `LLM` (`LLM.chat`): the model's chat template, a history that
can be saved and loaded, and a token context that only grows (`conversation.GrowingContext`), so
each turn prefills just its own tokens. With the plain template (models without a chat template,
like the built-in code model), answers stop by default at two blank lines (the end of a top-level
Python definition).

Tools (`LLM.chat(tools=[...], tool_choice=...)`, OpenAI's function schemas) work as on the server
(`lucebox.tools`): rendered by the chat template, the model's calls parsed from its own syntax
(`auto`), or the answer constrained to calls whose arguments follow the schemas (`required`, a named
function). An answer's calls are `Generation.tool_calls`; `send_tool_results` answers them.

A reasoning model's thought (`text.reasoning`) comes apart: `Chunk.reasoning` as it streams,
`Generation.reasoning`, and the answer's `reasoning_content` in the history, which the template renders
or drops as it was trained to (Qwen3's drops past turns' thoughts)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path

from lucebox import bounded_json
from lucebox.chat.answer_reader import AnswerReader
from lucebox.chat.conversation import GrowingContext, encode_all, render, turn_boundary
from lucebox.chat.saved_chat import TOOL_KEYS, chat_record, read_chat
from lucebox.chat.settings import DEFAULTS, PLAIN_STOP, check_settings, makes_json, model_defaults, own_stops
from lucebox.constrained.spec import refuse_stops
from lucebox.constrained.thought_first import thought_first_options
from lucebox.errors import ContextLengthError, InvalidArgumentError, ToolError
from lucebox.generation import Chunk, Generation, collect
from lucebox.output import write_new_file
from lucebox.request_options import RequestOptions
from lucebox.text.answer_split import AnswerSplit
from lucebox.text.json_calls import answer_text
from lucebox.text.reasoning import reasoning_format, starts_inside, thinking_off, thought_fields
from lucebox.text.tool_calls import FORMATS
from lucebox.tools import (
    CONSTRAINED_CALLS,
    ToolCall,
    ToolCallStream,
    ToolRequest,
    check_tools,
    model_tool_format,
    prompt_parts,
)


class ChatSession:
    """A conversation with `llm`; build it with `LLM.chat(system=None, **sampling)`."""

    def __init__(self, llm, system: str | None = None, tools: list[dict] | None = None, tool_choice=None,
                 parallel_tool_calls: bool | None = None, tool_parser: str | None = None, **sampling) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer  # a chat needs text: TokenizerError here when the model has none
        self.plain = not self.tokenizer.has_chat_template  # the plain template (see `conversation`)
        self.reasoning = None if self.plain else reasoning_format(self.tokenizer.chat_template())
        self.settings = {**DEFAULTS, **model_defaults(llm.description.generation_config),
                         "stop": list(PLAIN_STOP) if self.plain else None}
        self.set(**sampling)
        self.system = system
        self.messages: list[dict] = []
        # the last answer's figures (Chunk.stats); an answer cut short has those up to the cut and "cut": True
        self.last_stats: dict | None = None
        self.last_prompt_ids: list[int] = []  # the token ids the last turn's answer continued
        self.context = GrowingContext(self.tokenizer)
        self._tools = (tools, tool_choice, parallel_tool_calls, tool_parser)
        self.tool_request: ToolRequest | None = self._tool_request(self.settings)  # checked now: errors come early
        self.last_tool_calls: tuple[ToolCall, ...] = ()  # the calls of the last answer

    # -- what the conversation holds ----------------------------------------------------------------

    @property
    def history(self) -> list[dict]:
        """Every message so far, the system prompt first; a cut answer carries `"cut": True`."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [dict(m) for m in self.messages]

    @property
    def context_tokens(self) -> int:
        """Tokens of context the conversation holds now."""
        held = self.context.ids
        return len(held) if held is not None else len(encode_all(self.tokenizer, self._render(False)))

    def set(self, **settings) -> None:
        """Change the defaults of the next turns (`max_tokens`, `temperature`, `top_p`, `stop`, ...)."""
        merged = {**self.settings, **settings}
        check_settings(merged)
        self.settings = merged

    def reset(self) -> None:
        """Forget every message (the system prompt stays) and the cache that held them."""
        self.messages, self.last_stats, self.last_tool_calls = [], None, ()
        self.context.reset()
        self.llm.drop_cache()

    # -- turns --------------------------------------------------------------------------------------

    def send(self, text: str, **overrides) -> Generation:
        """One user turn; returns the whole answer (which joins the history). With tools, its
        `tool_calls` are the calls the model made and its text the content beside them."""
        return self._reply(self.stream(text, **overrides))

    def stream(self, text: str, **overrides) -> Iterator[Chunk]:
        """One user turn, its answer yielded as it is generated. Stopping early (closing the
        iterator, or an exception such as Ctrl-C's) keeps what was said so far, marked as cut.
        `overrides`: this turn's settings, and `tool_choice` / `parallel_tool_calls`."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"a chat message is text, got {type(text).__name__}")
        return self._turn([{"role": "user", "content": text}], overrides)

    def send_tool_results(self, results: dict[str, str], **overrides) -> Generation:
        """The results of the last answer's calls ({call id: result text}) as `tool` messages, and the
        model's next answer."""
        return self._reply(self.stream_tool_results(results, **overrides))

    def stream_tool_results(self, results: dict[str, str], **overrides) -> Iterator[Chunk]:
        """`send_tool_results`, its answer yielded as it is generated."""
        ids = {c.id: c.name for c in self.last_tool_calls}
        if not ids or not self.messages or not self.messages[-1].get("tool_calls"):
            raise InvalidArgumentError("tool results answer the calls of the last answer, and it made none")
        if not isinstance(results, dict) or not results:
            raise InvalidArgumentError("tool results are a dict {call id: result text}")
        for call_id, content in results.items():
            if call_id not in ids:
                raise InvalidArgumentError(f"no call of the last answer has the id {call_id!r}; they are "
                                           f"{', '.join(ids)}")
            if not isinstance(content, str):
                raise InvalidArgumentError(f"the result of call {call_id!r} must be text (a str), got "
                                           f"{type(content).__name__}")
        return self._turn([{"role": "tool", "tool_call_id": i, "name": ids[i], "content": c}
                           for i, c in results.items()], overrides)

    def _turn(self, new_messages: list[dict], overrides: dict) -> Iterator[Chunk]:
        tool_keys = {k: overrides.pop(k) for k in ("tool_choice", "parallel_tool_calls") if k in overrides}
        settings = {**self.settings, **overrides}
        check_settings(settings)
        request = self._tool_request(settings, **tool_keys)
        if request is not None and request.constraint:
            refuse_stops(own_stops(settings["stop"]), CONSTRAINED_CALLS)
            check_settings(settings := {**settings, **request.constraint})
        if makes_json(settings) or (request is not None and request.constraint):
            settings["stop"] = own_stops(settings["stop"]) or None  # the grammar ends the answer
        self.messages += new_messages
        try:
            prompt_text = self._render(add_generation_prompt=True)
            prompt_ids = self.context.prompt_ids(prompt_text)
            snapshots = turn_boundary(self.context.prompt_ids(self._render(add_generation_prompt=False)), prompt_ids)
            room = self.llm.max_context - len(prompt_ids)
            if room < 1:
                raise ContextLengthError(
                    f"the conversation and this message need {len(prompt_ids)} tokens of context, max_context is "
                    f"{self.llm.max_context}; start over (reset(), /reset) or open the model with a larger "
                    "max_context (--ctx)")
        except BaseException:
            del self.messages[-len(new_messages):]
            raise
        repeats = {"end_on_repeated_call": request.fmt, **thought_fields(self.reasoning, prompt_text)} if (
            request is not None and request.parses) else {}
        options = RequestOptions.from_keywords(**{**settings, "max_tokens": min(settings["max_tokens"], room),
                                                  "snapshot_at": snapshots, **repeats})
        # a reasoning model's constrained answer comes after its thought (`constrained.thought_first`)
        tool_grammar = request.constraint.get("grammar") if request is not None else None
        options = replace(options, **thought_first_options(self.reasoning, prompt_text, options, None, tool_grammar,
                                                           self.tokenizer.token_to_id))
        self.last_prompt_ids = prompt_ids
        end_ids, stops = self.llm.eos_token_ids, list(options.stop_strings)
        calls = None if request is None or not request.parses else ToolCallStream(
            self.tokenizer, request, end_ids, stops, prompt_ids)
        fmt = None if thinking_off(self.reasoning, prompt_text) else self.reasoning  # then all of it is content
        split = None if fmt is None else AnswerSplit(self.tokenizer, prompt_ids, end_ids, stops, fmt,
                                                     starts_inside(fmt, prompt_text), calls)
        return self._answer(prompt_text, prompt_ids, options, AnswerReader(split, calls))

    def _tool_request(self, settings: dict, **choice) -> ToolRequest | None:
        """The tools as this turn asks for them (`choice`: its tool_choice / parallel_tool_calls)."""
        tools, tool_choice, parallel, parser = self._tools
        if parser is not None and parser not in FORMATS:
            raise ToolError("tool_parser", f"must be one of {', '.join(FORMATS)} (or None: the chat template's "
                            f"own syntax), got {parser!r}")
        if tools is None and tool_choice is None and not choice:
            return None
        fmt, mistral_args = model_tool_format(self.llm, parser)
        other = next((k for k in ("json_schema", "grammar", "json_object") if settings[k] not in (None, False)), None)
        return check_tools(tools, choice.get("tool_choice", tool_choice), choice.get("parallel_tool_calls", parallel),
                           fmt, self.tokenizer.token_to_id, mistral_args, other)

    def _reply(self, chunks: Iterator[Chunk]) -> Generation:
        """The whole answer; with calls, the content beside them as its text."""
        answer = collect(chunks, has_text=True)
        if not self.last_tool_calls and self.messages[-1]["content"] == answer.text:
            return answer
        return replace(answer, _text=self.messages[-1]["content"] or "", tool_calls=self.last_tool_calls)

    def _answer(self, prompt_text: str, prompt_ids: list[int], options: RequestOptions,
                reader: AnswerReader) -> Iterator[Chunk]:
        self.last_tool_calls = ()
        last: Chunk | None = None
        finished = False
        try:
            with closing(self.llm.stream(prompt_ids, options)) as chunks:
                for chunk in chunks:
                    last = reader.read(chunk)
                    yield last
            finished = True
        except GeneratorExit:  # the caller stopped reading between two chunks: the engine is consistent
            raise
        except BaseException:
            # Raised inside a forward (Ctrl-C), the cache may be half-written: it starts over next turn.
            self.llm.drop_cache()
            raise
        finally:
            if finished:
                self.last_stats = last.stats
            else:  # cut: the engine's figures up to the cut, once the request had given a chunk (past its prefill)
                cut = self.llm.session.last_stats if last is not None else None
                self.last_stats = None if cut is None else {**cut, "cut": True}
            self._record(prompt_text, prompt_ids, reader, last if finished else None)

    def _record(self, prompt_text: str, prompt_ids: list[int], reader: AnswerReader, last: Chunk | None) -> None:
        answer, parsed, generated, raw = reader.answer, reader.parsed, reader.generated, reader.raw
        message = {"role": "assistant", "content": answer}
        if last is None:
            message["cut"] = True
        if reader.thought is not None:  # the template renders it, or drops it, as it was trained to
            message["reasoning_content"] = reader.thought
        past = self.history
        self.messages.append(message)
        if parsed is not None and parsed.calls:  # as templates read them: each call's arguments an object
            self.last_tool_calls = parsed.calls
            message["content"] = parsed.content.strip() or None
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": bounded_json.loads(c.arguments, "a call's arguments")}}
                for c in parsed.calls]
            self.context.reset()  # the template writes the calls its own way: tokenized whole next turn
            return
        if parsed is not None and answer_text(raw) is not None:  # the generic syntax's answer object: its text
            message["content"] = parsed.content
        if "reasoning_content" in message or message["content"] != raw:
            self.context.reset()  # the generated tokens are not the content alone: tokenized whole next turn
            return
        if last is None or last.finish_reason == "length":
            ended = "length"
        else:  # a stop: EOS and stop ids are generated tokens; a stop string's text is cut from the answer
            ended = "token" if generated and generated[-1] in self.llm.eos_token_ids else "string"
        self.context.record(prompt_text, prompt_ids, generated, answer, ended, lambda content: self._render(
            False, [*past, {"role": "assistant", "content": content}]))

    # -- saving and loading -------------------------------------------------------------------------

    def save(self, path: str | Path, overwrite: bool = False) -> None:
        """The conversation as JSON (system prompt, messages, settings) in a new file; an existing file
        is replaced only with `overwrite`, and only once the new one is complete."""
        given = any(value is not None for value in self._tools)
        opened_with = dict(zip(TOOL_KEYS, self._tools, strict=True)) if given else None
        write_new_file(path, chat_record(str(self.llm.description.folder), self.system, self.settings, self.messages,
                                         opened_with), overwrite=overwrite)

    def load(self, path: str | Path, on_progress: Callable[[int, int], None] | None = None) -> None:
        """Replace the conversation with a saved one and prefill it (`on_progress(done, total)`)."""
        record = read_chat(path)
        settings = {**DEFAULTS, **record.get("settings", {})}
        check_settings(settings)
        saved = record.get("tools") or {}
        tools = tuple(saved.get(k) for k in TOOL_KEYS)
        old = (self.system, self.messages, self.settings, self._tools, self.tool_request)
        self.system, self.messages, self.settings = record.get("system"), record["messages"], settings
        self._tools = tools
        try:
            self.tool_request = self._tool_request(settings)  # the saved tools, checked as when a chat opens
            rendered = self._render(add_generation_prompt=False)
            ids = encode_all(self.tokenizer, rendered)
            self.llm.prefill(ids, on_progress)
        except BaseException:
            self.system, self.messages, self.settings, self._tools, self.tool_request = old
            self.context.reset()
            self.llm.drop_cache()  # an interrupted prefill may have left the cache half-written
            raise
        self.context.reset(ids, rendered)
        self.last_tool_calls = _calls_awaiting_results(self.messages)

    # -- the template -------------------------------------------------------------------------------

    def _render(self, add_generation_prompt: bool, messages: list[dict] | None = None) -> str:
        """The conversation (or `messages`, the system prompt first) as the template writes it, with
        the tools when the chat has them."""
        messages, tools = self.history if messages is None else messages, None
        if self.tool_request is not None:
            messages, tools = prompt_parts(self.tokenizer, messages, self.tool_request)
        return render(self.tokenizer, messages, add_generation_prompt, tools)


def _calls_awaiting_results(messages: list[dict]) -> tuple[ToolCall, ...]:
    """The calls of a conversation's last message when it is an answer that made calls (a saved chat
    loaded there can go on with `send_tool_results`), else none."""
    last = messages[-1] if messages else {}
    return tuple(ToolCall(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False), c["id"])
                 for c in last.get("tool_calls") or ())
