"""The ASGI app of `lucebox serve` (starlette): OpenAI's /v1/models, /v1/chat/completions and
/v1/completions, streaming as server-sent events, plus /health and /metrics (Prometheus text)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from lucebox.chat.settings import PLAIN_STOP, model_defaults
from lucebox.errors import InvalidArgumentError, LuceboxError
from lucebox.server import openai_api as api
from lucebox.server.answer_parts import chunk_events, closing_events, whole_message
from lucebox.server.api_errors import mid_output_error
from lucebox.server.chat_prompt import engine_options, model_reasoning, prompt_of
from lucebox.server.choice_events import ChoiceEvents
from lucebox.server.choices import Answer, numbered, total_stats
from lucebox.server.guard import ClientLeft, HostGuard, check_key, read_json
from lucebox.server.logprobs_format import TokenText, logprobs_json
from lucebox.server.reasoning_fields import reasoning_ask
from lucebox.server.settings import ServerSettings
from lucebox.server.tools import tool_request
from lucebox.server.worker import EngineWorker, Job, slot_lines
from lucebox.text.answer_split import AnswerSplit
from lucebox.text.reasoning import starts_inside, thinking_off
from lucebox.tools import ToolCallStream, model_tool_format

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there


def build_app(llm, settings: ServerSettings) -> Starlette:
    """The app serving `llm`; its worker starts with the app and stops (cancelling what waits) with it."""
    state = _State(llm, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.worker = EngineWorker(llm, settings.max_queue)
        try:
            yield
        finally:
            await run_in_threadpool(state.worker.stop, settings.shutdown_timeout)

    routes = [Route("/health", state.health), Route("/metrics", state.metrics_text),
              Route("/v1/models", state.models), Route("/v1/chat/completions", state.chat, methods=["POST"]),
              Route("/v1/completions", state.completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(HostGuard, settings=settings)],
                    exception_handlers={404: _not_found, 405: _not_allowed, api.APIError: _api_error,
                                        ClientLeft: _client_left, Exception: _internal})
    app.state.lucebox = state
    return app


async def _api_error(request: Request, e: api.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _client_left(request: Request, e) -> Response:
    return Response(status_code=499)  # nobody reads it: the client closed the connection


async def _internal(request: Request, e: Exception) -> JSONResponse:
    return await _api_error(request, api.APIError(500, f"the engine failed: {type(e).__name__}: {e}"))


async def _not_found(request: Request, e) -> JSONResponse:
    return await _api_error(request, api.APIError(404, f"no route {request.url.path}; the API is under /v1"))


async def _not_allowed(request: Request, e) -> JSONResponse:
    return await _api_error(request, api.APIError(405, f"{request.method} is not allowed on {request.url.path}"))


class _State:
    def __init__(self, llm, settings: ServerSettings):
        self.llm, self.settings = llm, settings
        self.model_name = settings.model_name or llm.description.folder.name
        self.worker: EngineWorker | None = None
        self.defaults = model_defaults(llm.description.generation_config)
        self.tool_format, self.mistral_args = model_tool_format(llm, settings.tool_parser)
        self.reasoning, self.template = model_reasoning(llm)  # --reasoning-format none: not split off
        self.token_text = TokenText(llm.engine.tokenizer)  # logprobs' token texts, decoded once each

    # -- plain endpoints -------------------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        status = "stopping" if self.worker.stopping else "ok" if self.worker.alive else "engine thread died"
        return JSONResponse({"status": status, "queue_depth": self.worker.depth}, status_code=200 if
                            status == "ok" else 503)

    async def models(self, request: Request) -> JSONResponse:
        check_key(request, self.settings.api_key)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "lucebox",
            "max_model_len": self.llm.max_context}]})

    async def metrics_text(self, request: Request) -> PlainTextResponse:
        check_key(request, self.settings.api_key)
        m, memory = self.worker.metrics, self.worker.metrics.memory
        device_kv = memory["ring_caches"] + memory["kv_pool_device"] + memory["kv_chunk_summaries"]
        lines = []
        for name, kind, value, what in (
            ("requests_total", "counter", m.requests, "requests the engine finished or failed"),
            ("requests_failed_total", "counter", m.failed, "requests that ended in an error"),
            ("requests_cancelled_total", "counter", m.cancelled, "requests whose client left mid-answer"),
            ("prompt_tokens_total", "counter", m.prompt_tokens, "prompt tokens of finished requests"),
            ("cached_prompt_tokens_total", "counter", m.cached_prompt_tokens, "prompt tokens reused from the cache"),
            ("generated_tokens_total", "counter", m.generated_tokens, "tokens generated"),
            ("queue_depth", "gauge", self.worker.depth, "requests waiting or running"),
            ("decode_tokens_per_second", "gauge", m.last_decode_tokens_per_s, "decode speed of the last request"),
            ("prefill_tokens_per_second", "gauge", m.last_prefill_tokens_per_s, "prefill speed of the last request"),
            ("acceptance_length", "gauge", m.last_acceptance_length, "tokens per verify round, last request"),
            ("kv_device_bytes", "gauge", device_kv, "KV cache bytes on the device"),
            ("kv_host_bytes", "gauge", memory["kv_host"], "KV cache bytes in host memory"),
            ("weights_bytes", "gauge", memory["weights"], "weight bytes"),
            ("batched_forwards_total", "counter", self.llm.engine.batcher.forwards,
             "forwards that ran several requests' steps at once"),
            ("batched_drafts_cut_total", "counter", self.llm.engine.batcher.drafts_cut,
             "drafts a batched step left out for likelier ones, or as not paying for their rows"),
        ):
            lines += [f"# HELP lucebox_{name} {what}", f"# TYPE lucebox_{name} {kind}", f"lucebox_{name} {value}"]
        lines += slot_lines(m.slots)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -- completions -------------------------------------------------------------------------------------

    async def chat(self, request: Request):
        return await self._complete(request, "chat")

    async def completions(self, request: Request):
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: str):
        check_key(request, self.settings.api_key)
        body = await read_json(request, self.settings)
        req = api.parse_request(body, kind, self.llm.config.vocab_size, self.defaults)
        req.tools = tool_request(body, kind, self.tool_format, self._token_id, self.mistral_args)
        ask = reasoning_ask(body, self.reasoning, self.template, self.settings.reasoning_budget) if kind == "chat" \
            else None
        if req.echo:
            req.echo_text = api.echo_text(req.prompt, self.llm.engine.tokenizer)
        if req.model is not None and req.model != self.model_name:
            raise api.APIError(404, f"model '{req.model}' is not served here; this server has "
                                    f"'{self.model_name}' (GET /v1/models)", "model", "model_not_found")
        prompt = await run_in_threadpool(prompt_of, self.llm, req, ask.variables if ask else {})
        prompt_ids = prompt.ids
        room = self.llm.max_context - len(prompt_ids)
        if room < 1:
            raise api.APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server's context is "
                                    f"{self.llm.max_context} tokens (prompt + answer)", "messages" if
                               kind == "chat" else "prompt", "context_length_exceeded")
        stop = list(req.options.stop_strings) or (
            list(PLAIN_STOP) if kind == "chat" and not self.llm.tokenizer.has_chat_template else [])
        options = engine_options(req, prompt, room, stop, self.reasoning, ask, self._token_id)
        job = Job(prompt_ids, options, asyncio.get_running_loop(), req.n)
        self.worker.submit(job)
        rid = api.new_id(kind)
        try:
            first = await self._first_event(job, request, req)
        except BaseException:
            job.cancelled.set()
            raise
        inside = starts_inside(self.reasoning, prompt.text)
        off = thinking_off(self.reasoning, prompt.text) or self.settings.reasoning_format == "none"
        reasoning = None if off else self.reasoning  # else the whole answer is content
        parts = None if kind != "chat" else (lambda: AnswerSplit(  # one for each choice
            self.llm.tokenizer, prompt_ids, self.llm.eos_token_ids, stop, reasoning, inside,
            ToolCallStream(self.llm.tokenizer, req.tools, self.llm.eos_token_ids, stop, prompt_ids)
            if req.tools is not None and req.tools.parses else None))
        if req.stream:
            return _JobStream(job, self._events(req, job, rid, first, parts), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(req, job, rid, first, request, parts)

    def _token_id(self, text: str) -> int | None:
        """The id of the one token spelled `text` (a tool-call marker), or None."""
        tokenizer = self.llm.engine.tokenizer  # None without tokenizer files: the prompt is refused later
        return None if tokenizer is None else tokenizer.token_to_id(text)

    async def _first_event(self, job: Job, request: Request, req):
        """The first chunk, so that an error the engine meets before any output (a prompt it refuses)
        is still a proper error response, not a broken stream."""
        try:
            return await self._wait(job, request)
        except InvalidArgumentError as e:  # naming the request's field
            raise mid_output_error(e, req) from None
        except LuceboxError as e:
            raise api.APIError(400, str(e)) from None
        except (api.APIError, ClientLeft):
            raise
        except Exception as e:
            raise api.APIError(500, f"the engine failed: {type(e).__name__}: {e}") from None

    async def _wait(self, job: Job, request: Request):
        """The job's next event, watching the client: one that left cancels the job (ClientLeft)."""
        getter = asyncio.ensure_future(job.next())
        while True:
            # checked before every event, not only when none comes: a fast model always has one ready
            if await request.is_disconnected():
                job.cancelled.set()
                getter.cancel()
                raise ClientLeft
            done, _ = await asyncio.wait({getter}, timeout=POLL_SECONDS)
            if done:
                return getter.result()

    async def _whole(self, req, job: Job, rid: str, first, request: Request, parts) -> JSONResponse:
        """`parts()`: a new AnswerSplit (a chat), or None (a completion: the text as it is)."""
        answers, chunk = [Answer()], first
        while chunk is not None:
            if answers[-1].finish_reason is not None:  # the choice before ended: this chunk starts the next
                answers.append(Answer())
            answers[-1].add(chunk)
            try:
                chunk = await self._wait(job, request)
            except LuceboxError as e:  # nothing sent yet: a request it cannot serve is still a 400
                raise mid_output_error(e, req) from None
        bodies = [api.completion(req, rid, self.model_name, req.echo_text + a.text, a.finish_reason, a.stats)
                  for a in answers]
        for body, answer in zip(bodies, answers, strict=True):
            if req.options.logprobs is not None:
                body["choices"][0]["logprobs"] = logprobs_json(req.kind, answer.logprobs, self.token_text)
            if parts is not None:
                choice = body["choices"][0]
                message, choice["finish_reason"] = whole_message(parts(), answer.token_ids, answer.text,
                                                                 answer.finish_reason)
                choice["message"].update(message)
        return JSONResponse(numbered(bodies, api.usage(total_stats([a.stats for a in answers]))))

    async def _events(self, req, job: Job, rid: str, first, parts):
        model = self.model_name
        try:
            chunk, stats = first, []
            for index in range(req.n):
                if chunk is None:  # the job ended early (the server stopping)
                    break
                choice = ChoiceEvents(req, rid, model, index, self.token_text)
                if req.echo_text:  # every choice's text begins with the prompt, as a whole answer's does
                    echo = api.chunk(req, rid, model, req.echo_text, None)
                    echo["choices"][0]["index"] = index
                    yield _sse(echo)
                parse = parts() if parts is not None else None  # thought, content and calls as they come
                if req.kind == "chat":
                    yield _sse(choice.event("", None, first=True))
                while chunk is not None and not stats[index:]:
                    asked = req.options.logprobs is not None
                    events = chunk_events(choice, parse, chunk, asked) if parse is not None else (
                        [choice.event(chunk.text, None, chunk.logprobs)] if chunk.text or (asked and chunk.token_ids)
                        else [])
                    for event in events:
                        yield _sse(event)
                    if chunk.finish_reason is not None:
                        closing = [choice.event(None, chunk.finish_reason)] if parse is None else \
                            closing_events(choice, parse, chunk.finish_reason)
                        for event in closing:
                            yield _sse(event)
                        stats.append(chunk.stats)
                    chunk = await job.next()
            if req.include_usage and stats:
                yield _sse(api.usage_chunk(req, rid, model, total_stats(stats)))
            yield b"data: [DONE]\n\n"
        except LuceboxError as e:  # mid-stream: the status line is gone, so the error is an event
            yield _sse(mid_output_error(e, req).body())
            yield b"data: [DONE]\n\n"
        except api.APIError as e:  # the server stopping
            yield _sse(e.body())
            yield b"data: [DONE]\n\n"
        except Exception as e:
            yield _sse(api.APIError(500, f"the engine failed: {type(e).__name__}: {e}").body())
            yield b"data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client that left (this generator closed) cancels at the next token


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


class _JobStream(StreamingResponse):
    """A streamed answer whose job is cancelled however the response ends, even when the client left
    before its first event (starlette then never starts the body's generator)."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled.set()
