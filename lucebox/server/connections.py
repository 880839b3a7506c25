"""uvicorn as `lucebox serve` runs it: bounded connections, headers and idle time.

uvicorn bounds the idle time between requests and the number of connections, but a connection that
opens and then sends nothing, or half a request's headers, is held forever. `HeaderDeadlineProtocol`
closes it once --read-timeout passes without complete headers; the body has its own deadline in the
app (`guard.read_json`).

h11 bounds a request's head (line and headers) only while it is incomplete: a head that arrives
whole in one read (uvicorn reads up to 256 KiB at once) is parsed whatever its size. `BoundedHead`
measures every head h11 parses, so no head over MAX_HEADER_BYTES is served, however it arrives:
the client gets 431 and the connection closes."""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lucebox.server.api_errors import APIError
from lucebox.server.settings import ServerSettings

KEEP_ALIVE_SECONDS = 5  # an idle connection between two requests (uvicorn's default)
MAX_HEADER_BYTES = 16 * 1024  # a request's line and headers together (h11's default)


class ServeConfig(uvicorn.Config):
    """uvicorn's configuration plus the seconds a connection has to send a request's headers."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout


def uvicorn_config(app, settings: ServerSettings) -> ServeConfig:
    return ServeConfig(app, host=settings.host, port=settings.port, log_level="warning",
                       http=HeaderDeadlineProtocol, header_timeout=settings.read_timeout,
                       timeout_keep_alive=KEEP_ALIVE_SECONDS, limit_concurrency=settings.max_connections,
                       h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                       timeout_graceful_shutdown=settings.shutdown_timeout)


class BoundedHead(h11.Connection):
    """h11's server side, refusing (RemoteProtocolError, status 431) any request head over `limit` bytes."""

    def __init__(self, limit: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=limit)
        self.limit = limit
        self.head_too_large = False  # why the last RemoteProtocolError was raised, for the answer

    def next_event(self):
        if self.their_state is not h11.IDLE:  # a body, or the end of a request: no head to measure
            return super().next_event()
        buffered = len(self.trailing_data[0])
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:  # an incomplete head over the limit is h11's own 431
            self.head_too_large = e.error_status_hint == 431
            raise
        if isinstance(event, h11.Request) and buffered - len(self.trailing_data[0]) > self.limit:
            self.head_too_large = True
            raise h11.RemoteProtocolError(f"request head over {self.limit} bytes", error_status_hint=431)
        return event


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers: armed when the
    connection opens and when bytes arrive between two requests, disarmed when a request's headers
    are complete (uvicorn then starts its cycle), and on expiry the connection is closed."""

    deadline: asyncio.TimerHandle | None = None

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.conn = BoundedHead(config.h11_max_incomplete_event_size or MAX_HEADER_BYTES)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused: 431 in OpenAI's error JSON for a head too large."""
        if not self.conn.head_too_large:
            return super().send_400_response(msg)
        message = f"the request's line and headers are over {self.conn.limit} bytes, the most this server reads"
        body = json.dumps(APIError(431, message, code="request_header_fields_too_large").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # the next request's first bytes
            self.arm()
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers came whole
            self.disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def arm(self) -> None:
        if self.deadline is None:
            self.deadline = self.loop.call_later(self.config.header_timeout, self.expire)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        self.deadline = None
        if not self.transport.is_closing():
            self.transport.close()
