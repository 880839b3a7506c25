"""`lucebox serve [MODEL]`: the OpenAI-compatible server on uvicorn, localhost unless asked."""

from __future__ import annotations

import argparse
import signal
import sys

from lucebox.cli.engine_flags import add_engine_flags, open_engine
from lucebox.errors import InvalidArgumentError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over the OpenAI API (chat/completions, streaming)",
                       description="Serve a model over OpenAI's HTTP API: POST /v1/chat/completions and "
                                   "/v1/completions (streaming or not), GET /v1/models, /health, /metrics. "
                                   "One engine runs one request at a time; the others wait in a queue.")
    add_engine_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 request")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its folder's)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests that may wait for the engine; past it, 429 with Retry-After (default 32)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds Ctrl-C / SIGTERM lets running requests finish before cancelling them")


def command(args: argparse.Namespace) -> int:
    import uvicorn

    from lucebox.server.app import ServerSettings, build_app
    from lucebox.server.graceful import GracefulServer

    for flag, value, low in (("--port", args.port, 0), ("--max-queue", args.max_queue, 1),
                             ("--max-body-bytes", args.max_body_bytes, 1024)):
        if value < low:
            raise InvalidArgumentError(f"{flag} must be at least {low}, got {value}")
    if args.host not in LOCAL_HOSTS and args.api_key is None:
        print(f"lucebox serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    llm = open_engine(args)
    name = args.served_model_name or llm.description.folder.name
    app = build_app(llm, ServerSettings(name, args.api_key, args.max_queue, args.max_body_bytes,
                                        args.shutdown_timeout))
    print(f"lucebox serve: '{name}' at http://{args.host}:{args.port}/v1 (OpenAI API); Ctrl-C stops",
          file=sys.stderr, flush=True)
    # uvicorn turns Ctrl-C and SIGTERM into a graceful shutdown, then raises the signal again for the
    # handler it found; with these no-op handlers that re-raise ends nothing and the exit status is 0.
    quiet = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    try:
        GracefulServer(config, app.state.lucebox).run()
    finally:
        for sig, handler in quiet.items():
            signal.signal(sig, handler)
    print("lucebox serve: stopped", file=sys.stderr)
    return 0

