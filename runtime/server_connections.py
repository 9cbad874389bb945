"""What one slow or silent client may hold of the server: time limits on every phase of a
connection and a cap on how many are open (issue 31: slowloris headers, a body shorter than its
Content-Length and silent connections were each held 100 s or more; enough of them exhausted the
process's file limit).

aiohttp reads headers with no time limit of its own, and its keep-alive timer also runs out
while a client is still sending headers, closing it without a word. So every connection is
watched by a thin protocol (`_Watch`) between the transport and aiohttp's request handler; it
forwards every call and keeps one deadline for the connection's phase:

- fresh: the first request's headers must arrive within `header_timeout_s` of the connect; a
  client that sent nothing is closed, one that sent part of its headers gets a 408 and is closed.
- headers: a later request's headers must arrive within `header_timeout_s` of its first byte.
- busy: a handler runs; the middleware reads the whole body first, within `body_timeout_s` of the
  headers, or answers 408 and closes (the rest of the body would be read as the next request).
- idle: between requests, a keep-alive connection is closed after `keep_alive_timeout_s` without
  a byte (unless the last response is still being sent to a slow reader).

Beyond `max_connections` open ones a new connection is answered 503 at once and closed. Each drop
is counted by reason for /metrics. aiohttp's own keep-alive timer stays as a backstop set beyond
ours, so it never closes a connection first.
"""

from __future__ import annotations

import asyncio
import json
import math
import resource
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from compile_engine.runtime.protocol import APIError
from compile_engine.runtime.server_common import too_large_message

DROP_REASONS = ("header_timeout", "body_timeout", "keep_alive_timeout", "max_connections")

# Descriptors kept for what is not a client connection (the model files, the engine's pipes,
# a refused connection's last second) when the connection cap is derived from the file limit.
FILE_RESERVE = 128
DEFAULT_MAX_CONNECTIONS = 1024
# A connection answered without aiohttp (a 503 over the cap, a 408 for late headers) reads and
# drops what the client still sends for this long before it closes, so that the client reads the
# answer rather than a reset.
_DRAIN_S = 1.0

_FRESH, _HEADERS, _BUSY, _IDLE, _CLOSING, _DONE, _REFUSED, _DRAINING = range(8)


class LimitsError(ValueError):
    """A connection limit that cannot work; the message names it."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """`compile-engine serve --header-timeout --body-timeout --timeout-keep-alive
    --max-connections`, in seconds and connections."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise LimitsError(f"{name} must be a number of seconds, got {value!r}")
            if not 0 < value < math.inf:
                raise LimitsError(f"{name} must be > 0 seconds and finite, got {value}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise LimitsError(f"max_connections must be an integer, got {self.max_connections!r}")
        if self.max_connections < 1:
            raise LimitsError(f"max_connections must be >= 1, got {self.max_connections}")


def file_limit() -> int:
    """The process's soft limit on open files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_max_connections() -> int:
    """DEFAULT_MAX_CONNECTIONS, or fewer where the file limit would run out first."""
    return max(1, min(DEFAULT_MAX_CONNECTIONS, file_limit() - FILE_RESERVE))


class ConnectionGuard:
    """The watches of one app's connections, their count and drops; see the module doc."""

    def __init__(self, limits: ConnectionLimits, max_body_bytes: int) -> None:
        self.limits = limits
        self.max_body_bytes = max_body_bytes
        self.open = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._watches: dict[asyncio.BaseTransport, _Watch] = {}

    def protocol_factory(self, handler: Callable[[], asyncio.Protocol]) -> Callable[[], _Watch]:
        """Wrap aiohttp's protocol factory (the runner's server) so each connection is watched."""
        return lambda: _Watch(self, handler())

    def runner_options(self) -> dict[str, float]:
        """aiohttp's own timers, set so that ours always act first."""
        limits = self.limits
        backstop = limits.header_timeout_s + limits.keep_alive_timeout_s + 1.0
        # aiohttp reads the rest of a body it did not need for this long before it closes; the
        # body timeout bounds it too.
        return {"keepalive_timeout": backstop, "lingering_time": min(10.0, limits.body_timeout_s)}

    def watch_of(self, request: web.BaseRequest) -> _Watch | None:
        """The watch of the connection `request` came on; None if it came another way (a
        site this guard does not watch)."""
        return self._watches.get(request.transport)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The app's outermost middleware: marks the connection busy while a handler runs and
        reads the request's body within the body timeout before the handler sees it."""

        @web.middleware
        async def connection_phase(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            watch = self.watch_of(request)
            if watch is None:
                return await handler(request)
            watch.request_started()
            try:
                refused = await self._read_body(request, watch)
                return refused if refused is not None else await handler(request)
            finally:
                watch.request_done(body_read=request.content.is_eof())

        return connection_phase

    async def _read_body(self, request: web.Request, watch: _Watch) -> web.StreamResponse | None:
        length = request.content_length
        if not request.body_exists or (length is not None and length > self.max_body_bytes):
            return None  # nothing to read, or the handler refuses it by its length (413)
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                await request.read()  # kept by aiohttp: the handler's read() returns it
        except TimeoutError:
            error = APIError(
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                code="request_timeout",
            )
            return await watch.drop_with(request, error, "body_timeout")
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            error = APIError(413, too_large_message(self.max_body_bytes), code="request_too_large")
            return await watch.drop_with(request, error, None)
        return None


class _Watch(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's handler and keeps its phase's deadline."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._phase = _FRESH
        self._timer: asyncio.TimerHandle | None = None

    # -- the transport's calls, forwarded -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        guard = self._guard
        if guard.open >= guard.limits.max_connections:
            self._refuse()
            return
        guard.open += 1
        guard._watches[transport] = self
        self._inner.connection_made(transport)
        self._arm(guard.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._phase in (_REFUSED, _DRAINING):
            return
        if self._phase == _IDLE and data:
            self._phase = _HEADERS
            self._arm(self._guard.limits.header_timeout_s)
        elif self._phase == _FRESH and data:
            self._phase = _HEADERS  # its deadline still counts from the connect
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._phase in (_REFUSED, _DRAINING):
            return None  # the transport closes
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._phase == _REFUSED:
            return
        self._phase = _DONE
        guard = self._guard
        if guard._watches.pop(self._transport, None) is not None:
            guard.open -= 1
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._phase != _REFUSED:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._phase != _REFUSED:
            self._inner.resume_writing()

    # -- phases, from the middleware ------------------------------------------------------------

    def request_started(self) -> None:
        self._cancel()
        self._phase = _BUSY

    def request_done(self, body_read: bool) -> None:
        if self._phase != _BUSY:
            return  # dropped meanwhile
        if not body_read:
            # aiohttp reads the unread rest for up to lingering_time, then closes.
            self._phase = _CLOSING
            return
        self._phase = _IDLE
        self._arm(self._guard.limits.keep_alive_timeout_s)

    async def drop_with(
        self, request: web.Request, error: APIError, reason: str | None
    ) -> web.StreamResponse:
        """Answer `error` and close the connection once it is sent; count `reason`."""
        response = web.json_response(error.body(), status=error.status)
        response.force_close()
        if reason is not None:
            self._guard.dropped[reason] += 1
        self._phase = _DONE
        try:
            await response.prepare(request)
            await response.write_eof()
        finally:
            # aiohttp's own close: the buffered answer is flushed first, nothing lingers.
            request.protocol.force_close()
        return response

    # -- deadlines ------------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        guard = self._guard
        if self._phase == _IDLE:
            if transport.get_write_buffer_size():  # still sending the last answer
                self._arm(guard.limits.keep_alive_timeout_s)
                return
            guard.dropped["keep_alive_timeout"] += 1
        elif self._phase == _HEADERS:
            guard.dropped["header_timeout"] += 1
            seconds = guard.limits.header_timeout_s
            error = APIError(
                408,
                f"the request headers did not arrive within {seconds:g} s",
                code="request_timeout",
            )
            self._phase = _DRAINING  # aiohttp's parser gets no more bytes
            self._answer_and_close(_raw_response(error, "Request Timeout"))
            return
        elif self._phase == _FRESH:
            guard.dropped["header_timeout"] += 1
        else:
            return
        self._phase = _DONE
        transport.close()

    def _answer_and_close(self, response: bytes) -> None:
        transport = self._transport
        transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_DRAIN_S, transport.close)

    def _refuse(self) -> None:
        """Over the cap: answer 503 and close, without ever handing the connection to aiohttp."""
        self._phase = _REFUSED
        guard = self._guard
        guard.dropped["max_connections"] += 1
        error = APIError(
            503,
            f"the server has {guard.limits.max_connections} connections open, its limit; "
            "retry shortly",
            type="server_error",
            code="too_many_connections",
        )
        self._answer_and_close(_raw_response(error, "Service Unavailable", "Retry-After: 1\r\n"))


def _raw_response(error: APIError, reason: str, headers: str = "") -> bytes:
    """An error answer written straight to the transport, where aiohttp is not answering."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n"
    )
    return head.encode() + body


class GuardedSite(web.BaseSite):
    """An aiohttp site on a bound socket whose connections `guard` watches (aiohttp's SockSite
    with the protocol factory wrapped; BaseSite is aiohttp's base for such sites)."""

    __slots__ = ("_sock", "_guard", "_name")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=1024)
        self._sock = sock
        self._guard = guard
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._guard.protocol_factory(server), sock=self._sock, backlog=self._backlog
        )
