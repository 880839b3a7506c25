"""`lucebox serve [MODEL]`: the OpenAI-compatible server on uvicorn, localhost unless asked."""

from __future__ import annotations

import argparse
import signal
import sys
import warnings

from lucebox.engine_flags import add_engine_flags, engine_config, open_engine
from lucebox.errors import ContextLengthError, InsufficientMemoryError, LuceboxWarning
from lucebox.limits import SERVE_PARALLEL
from lucebox.server.settings import ServerSettings
from lucebox.text.tool_calls import FORMATS


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over the OpenAI API (chat/completions, streaming)",
                       description="Serve a model over OpenAI's HTTP API: POST /v1/chat/completions and "
                                   "/v1/completions (streaming or not), GET /v1/models, /health, /metrics. "
                                   "One engine runs --parallel requests at once (their steps share each "
                                   "forward); the others wait in a queue. "
                                   "POST bodies must be JSON (Content-Type: application/json), and a request's "
                                   "Host must name this server: localhost, 127.0.0.1, [::1], the --host address "
                                   "or an --allowed-host; on 0.0.0.0 or :: also any IP address, and with "
                                   "--api-key any name.")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 or :: for every "
                        "interface, then set --api-key)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics; set one whenever other machines "
                        "can reach the server")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a host name clients use to reach this server, accepted in the Host header beside "
                        "localhost and the --host address (repeatable; blocks DNS-rebinding pages)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its folder's)")
    p.add_argument("--parallel", type=int, default=None,
                   help=f"requests run at once, each in a slot with its own cache and drafter, their steps "
                        f"batched into one forward; 1 runs one at a time (default: {SERVE_PARALLEL}, or as many "
                        "as the memory plan fits)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests that may wait for the engine; past it, 429 with Retry-After (default 32)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)")
    p.add_argument("--max-connections", type=int, default=128,
                   help="open connections at once; past it, requests get 503 (default 128)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, then again its body; past them the "
                        "connection is closed, or the answer is 408 (default 30)")
    p.add_argument("--tool-parser", default=None, choices=FORMATS,
                   help="the syntax of the model's tool calls (default: the one its chat template writes: "
                        "<tool_call> is hermes, [TOOL_CALLS] mistral, <|python_tag|> llama3; a template with none "
                        "gets json, one JSON object of calls or answer that the grammar forces)")
    p.add_argument("--reasoning-format", default="auto", choices=("auto", "none"),
                   help="auto: a reasoning model's thought comes apart as reasoning_content (<think> for Qwen3 and "
                        "DeepSeek-R1, gpt-oss's analysis channel); none: it stays in content (default auto)")
    p.add_argument("--reasoning-budget", type=int, default=-1,
                   help="thought tokens after which the close is forced and the model answers (a request's "
                        "reasoning_budget overrides it; 0 turns thinking off; default -1: no bound)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds Ctrl-C / SIGTERM lets running requests finish before cancelling them")


def settings_from(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from its flags, checked (before the engine opens); a warning when
    anyone on the network could use the model."""
    settings = ServerSettings(args.served_model_name, args.host, args.port, args.api_key, tuple(args.allowed_host),
                              args.max_queue, args.max_body_bytes, args.max_connections, args.read_timeout,
                              args.shutdown_timeout, args.tool_parser, args.reasoning_format,
                              args.reasoning_budget)
    if settings.public and settings.api_key is None:
        names = "; clients must reach it by IP address or an --allowed-host name" if settings.every_interface else ""
        warnings.warn(f"listening on {settings.host} without --api-key: anyone who can reach this machine can "
                      f"use the model{names}", LuceboxWarning, stacklevel=2)
    return settings


def command(args: argparse.Namespace) -> int:
    from lucebox.server.app import build_app
    from lucebox.server.connections import uvicorn_config
    from lucebox.server.graceful import GracefulServer

    settings = settings_from(args)
    llm = open_serving_engine(args)
    app = build_app(llm, settings)
    name = app.state.lucebox.model_name
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # an IPv6 address, as URLs write it
    print(f"lucebox serve: '{name}' at http://{host}:{settings.port}/v1 (OpenAI API); Ctrl-C stops",
          file=sys.stderr, flush=True)
    # uvicorn turns Ctrl-C and SIGTERM into a graceful shutdown, then raises the signal again for the
    # handler it found; with these no-op handlers that re-raise ends nothing and the exit status is 0.
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        GracefulServer(uvicorn_config(app, settings), app.state.lucebox).run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    print("lucebox serve: stopped", file=sys.stderr)
    return 0


def open_serving_engine(args: argparse.Namespace):
    """The engine with `--parallel` slots; without the flag, SERVE_PARALLEL of them, or as many as
    the memory plan fits with the choices it makes for one (under --vram the planner would shrink
    the pool or the prefill chunk, or move experts to host memory, to fit more: a single client
    would pay for slots it may never use), said on stderr when fewer."""
    if args.parallel is not None:
        return open_engine(args, parallel=args.parallel)
    parallel = slots_that_fit(args)
    if parallel == 0:  # not even one: opening the engine says why
        return open_engine(args, parallel=1)
    if parallel < SERVE_PARALLEL:
        print(f"lucebox serve: the caches of {SERVE_PARALLEL} requests at once do not fit; serving {parallel} "
              "at once (--parallel N chooses)", file=sys.stderr)
    return open_engine(args, parallel=parallel)


def slots_that_fit(args: argparse.Namespace) -> int:
    """The most slots, up to SERVE_PARALLEL, whose plan fits with the choices one slot's plan makes
    (0 when even one does not fit)."""
    from lucebox.engine.setup import plan_engine

    try:
        one = plan_engine(engine_config(args, parallel=1))
    except (InsufficientMemoryError, ContextLengthError):
        return 0
    for parallel in range(SERVE_PARALLEL, 1, -1):
        try:
            setup = plan_engine(engine_config(args, parallel=parallel))
        except (InsufficientMemoryError, ContextLengthError):
            continue
        if (setup.prefill_chunk, setup.cache.kv_pool_tokens, setup.expert_slots) == (
                one.prefill_chunk, one.cache.kv_pool_tokens, one.expert_slots):
            return parallel
    return 1
