"""What `lucebox serve`'s own flags set (the engine's go to an EngineConfig): one field per flag,
every value checked once, when the settings are built, before the engine opens."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from lucebox.errors import InvalidArgumentError
from lucebox.text.tool_calls import FORMATS

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
EVERY_INTERFACE = ("0.0.0.0", "::")
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?")  # a DNS name as a Host header carries it
_KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces
_PORT = re.compile(r"(:[0-9]{1,5})?")  # what may follow the host in a Host header
MAX_SECONDS = 86400  # a timeout flag's most: thread and event-loop waits overflow near 2^31 s (inf at once)


def host_name(text: str) -> str | None:
    """The host of a Host header or of a flag, in one spelling ('[::1]:8000' -> '::1',
    'LocalHost.' -> 'localhost'), or None when it is neither a DNS name nor an IP address."""
    text = text.strip().lower()
    if text.startswith("["):  # an IPv6 literal, as URLs and Host headers write it
        inside, _, port = text[1:].partition("]")
        return inside if is_address(inside) and _PORT.fullmatch(port) else None
    if is_address(text):  # a bare IPv6 address (a flag's spelling) or an IPv4 one
        return text
    name, colon, port = text.partition(":")
    if not _PORT.fullmatch(colon + port):
        return None
    name = name.removesuffix(".")
    return name if _NAME.fullmatch(name) else None


def is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    return host == "localhost" or (is_address(host) and ipaddress.ip_address(host).is_loopback)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str | None = None  # None: the model folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beyond the loopback names and --host
    max_queue: int = 32
    max_body_bytes: int = 4 * 2**20
    max_connections: int = 128
    read_timeout: float = 30.0  # for a request's headers, then again for its body
    shutdown_timeout: float = 10.0
    tool_parser: str | None = None  # a tool-call syntax (text.tool_calls.FORMATS); None: the chat template's
    reasoning_format: str = "auto"  # "auto": the thought apart when the template writes one; "none": in content
    reasoning_budget: int = -1  # the thought's most tokens (a request may set its own); 0: off; -1: no bound

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise InvalidArgumentError("--api-key is empty, which would turn authentication off: give a key "
                                       "(for example from `openssl rand -hex 16`), or leave the flag out to serve "
                                       "this machine only")
        if self.api_key is not None and not _KEY.fullmatch(self.api_key):
            # a header carries it: other characters would never match what a client sends
            raise InvalidArgumentError("--api-key must be printable ASCII without spaces")
        if host_name(self.host) is None:
            raise InvalidArgumentError(f"--host {self.host!r} is neither an IP address nor a host name")
        for name in self.allowed_hosts:
            written = name.strip().lower().removesuffix(".")
            if host_name(name) not in (written, written.strip("[]")):
                raise InvalidArgumentError(f"--allowed-host {name!r} is not a host name or IP address (give the "
                                           "name clients use, without a scheme or port, e.g. gpu-box.lan)")
        for flag, value, low, high in (("--port", self.port, 0, 65535), ("--max-queue", self.max_queue, 1, None),
                                       ("--max-body-bytes", self.max_body_bytes, 1024, None),
                                       ("--max-connections", self.max_connections, 2, None)):
            if value < low:
                raise InvalidArgumentError(f"{flag} must be at least {low}, got {value}")
            if high is not None and value > high:
                raise InvalidArgumentError(f"{flag} must be at most {high}, got {value}")
        if self.tool_parser is not None and self.tool_parser not in FORMATS:
            raise InvalidArgumentError(f"--tool-parser must be one of {', '.join(FORMATS)}, got {self.tool_parser!r}")
        if self.reasoning_format not in ("auto", "none"):
            raise InvalidArgumentError(f"--reasoning-format must be auto or none, got {self.reasoning_format!r}")
        if self.reasoning_budget < -1:
            raise InvalidArgumentError(f"--reasoning-budget must be -1 (no bound), 0 (thinking off) or a number of "
                                       f"tokens, got {self.reasoning_budget}")
        for flag, seconds in (("--read-timeout", self.read_timeout), ("--shutdown-timeout", self.shutdown_timeout)):
            if not 0 < seconds <= MAX_SECONDS:  # NaN fails both; inf overflows the waits that take it
                raise InvalidArgumentError(f"{flag} must be a positive number of seconds, at most {MAX_SECONDS} "
                                           f"(a day), got {seconds}")

    @property
    def every_interface(self) -> bool:
        """Listening on all of this machine's addresses (0.0.0.0 or ::): the user wants remote clients."""
        return host_name(self.host) in EVERY_INTERFACE

    @property
    def public(self) -> bool:
        """Reachable from other machines."""
        return not is_loopback(host_name(self.host))

    def accepted_hosts(self) -> tuple[frozenset[str], bool, bool]:
        """(the Host names always accepted, whether any IP address is, whether any name is).

        A page that rebinds its own DNS name to this machine sends that name as the Host, never an
        IP address, and cannot know the API key: so a server on every interface accepts any address,
        and any name when it has a key."""
        names = frozenset({*LOOPBACK_NAMES, host_name(self.host), *(host_name(h) for h in self.allowed_hosts)})
        return names, self.every_interface, self.every_interface and self.api_key is not None
