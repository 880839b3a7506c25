"""What a request must show before the server reads or runs it: a Host naming this server (DNS
rebinding), the API key, a JSON content type (a cross-site form or text/plain POST needs no CORS
preflight, a JSON one does), and a body that arrives whole, in time and within the size limit."""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from lucebox import bounded_json
from lucebox.bounded_json import ENVELOPE_DEPTH, MAX_DEPTH
from lucebox.errors import JSONInputError
from lucebox.server.openai_api import APIError
from lucebox.server.settings import ServerSettings, host_name, is_address

# An answer given before the whole body came closes the connection: the rest of a body it did not
# read must not be taken for the next request, nor keep the connection open.
_CLOSE = {"Connection": "close"}


class ClientLeft(Exception):
    """The client closed its connection while its request was read, waited or ran."""


class HostGuard:
    """ASGI middleware: every HTTP request whose Host header does not name this server gets 403,
    before any route runs (`ServerSettings.accepted_hosts` says which names do)."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.names, self.any_address, self.any_name = settings.accepted_hosts()

    def accepts(self, header: str | None) -> bool:
        name = host_name(header) if header else None
        if name is None:
            return False
        return name in self.names or self.any_name or (self.any_address and is_address(name))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host")
            if not self.accepts(header):
                shown = repr(header[:100]) if header else "none"
                error = APIError(403, f"this server does not answer to the Host {shown}: reach it as localhost or "
                                      "by its address, or start it with --allowed-host NAME", code="host_not_allowed")
                await JSONResponse(error.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_key(request: Request, key: str | None) -> None:
    """401 unless the request carries 'Authorization: Bearer <key>' (any request, when no key is set)."""
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})


async def read_json(request: Request, settings: ServerSettings):
    """The decoded JSON body: 415 unless the content type is JSON, 413 past the size limit, 408 when
    it does not arrive within the read timeout, ClientLeft when the client goes while sending it."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        shown = repr(media_type[:100]) if media_type else "none"
        raise APIError(415, f"the request's Content-Type is {shown}; send the body as JSON with "
                            "'Content-Type: application/json'", code="unsupported_media_type")
    try:
        body = await asyncio.wait_for(_body(request, settings.max_body_bytes), settings.read_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {settings.read_timeout:g} s "
                            "(--read-timeout): is its Content-Length right?", headers=_CLOSE) from None
    except ClientDisconnect:
        raise ClientLeft from None
    try:
        return bounded_json.loads(body, "the request body", max_depth=MAX_DEPTH + ENVELOPE_DEPTH)
    except JSONInputError as e:  # not JSON, not UTF-8, a huge number, deep nesting
        raise APIError(400, str(e)) from None


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}",
                       headers=_CLOSE)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the request body is over {limit} bytes, the most this server takes", headers=_CLOSE)
    return bytes(body)
