"""uvicorn as `lucebox serve` runs it: bounded connections, headers and idle time.

uvicorn bounds the size of a request's headers, the idle time between requests and the number of
connections, but a connection that opens and then sends nothing, or half a request's headers, is
held forever. `HeaderDeadlineProtocol` closes it once --read-timeout passes without complete
headers; the body has its own deadline in the app (`guard.read_json`)."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

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


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's headers: armed when the
    connection opens and when bytes arrive between two requests, disarmed when a request's headers
    are complete (uvicorn then starts its cycle), and on expiry the connection is closed."""

    deadline: asyncio.TimerHandle | None = None

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
