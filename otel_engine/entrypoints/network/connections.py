"""Bounded resources per client connection, enforced below the app (uvicorn's h11 protocol).

- **Connection limit.** Past `max_connections` open connections, a new one first evicts the
  oldest connection that has no request in progress (idle keep-alive, or never sent a whole
  request); if every connection is busy it is answered 503 `too_many_connections` and closed
  at once, so file descriptors never run out and the accept loop never fails.
- **Request read deadline.** A connection must deliver a complete request (headers and body)
  within `request_read_timeout` of its first byte (or of opening): slow or silent clients are
  closed (408 when part of a request arrived).
- **Slow readers.** `ClientReader` (in each request's ASGI scope under `CLIENT_READER_KEY`)
  tells a stream how many of its bytes wait unsent because the client does not take them
  (the kernel's unsent send queue, `SIOCOUTQNSD`, plus the transport's buffer): a stream
  pauses its request once that passes `slow_reader_bytes`, a few chunks after the client's
  receive buffer filled, and resumes when the client caught up.
- **Write stall deadline.** A response that cannot be written for `stream_write_timeout`
  (the client stopped reading and the buffers are full, or a paused stream's client did not
  catch up) is aborted; the request behind it sees a disconnect and is counted as
  `client_stalled`. Socket send buffers are kept small, so a response whose client stops
  reading holds tens of kilobytes, not megabytes.

- **Strict framing.** A request with both `Content-Length` and `Transfer-Encoding` (a
  proxy that frames by length would see another request in its body: RFC 9112 section 6.3)
  and a request head with a bare LF line ending are answered 400 `invalid_framing` and the
  connection is closed, before the app sees them.

Repeated log lines of each kind are limited to one a second (`log_limits.RateLimitedLog`),
uvicorn's warnings about malformed requests included.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import time
from http import HTTPStatus
from typing import Any, ClassVar

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from otel_engine.entrypoints.network import uvicorn_internals
from otel_engine.entrypoints.network.errors import INVALID_REQUEST, UNAVAILABLE, APIError
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.errors import ErrorCode
from otel_engine.observability.label_sets import ConnectionCloseReason
from otel_engine.observability.log_limits import RateLimitedLog
from otel_engine.observability.metrics import EngineMetrics
from otel_engine.timing import READER_POLL_MAX_S, READER_POLL_MIN_S, REFUSE_LINGER_S

logger = logging.getLogger("otel_engine.api_server")

# Set in a request's ASGI scope when its connection was aborted for not reading.
CLIENT_STALLED_KEY = "otel_engine.client_stalled"
CLIENT_READER_KEY = "otel_engine.client_reader"  # the request's `ClientReader`
SIOCOUTQNSD = 0x894B  # linux/sockios.h: bytes in the send queue not yet sent
_END_OF_HEAD = b"\r\n\r\n"


class FramingError(Exception):
    """A request whose framing an intermediary could read differently (see `StrictConnection`)."""


class StrictConnection(h11.Connection):
    """h11's server connection without the leniency that lets a request be framed two ways:
    `next_event` raises `FramingError` for a request with both `Content-Length` and
    `Transfer-Encoding`, and for a request head with a line that ends in a bare LF."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._head = b""  # the current request head's bytes so far (until its blank line)
        self._is_head_read = False
        self._error: str | None = None

    def receive_data(self, data: bytes) -> None:
        if self.their_state is h11.IDLE and not self._is_head_read and data:
            self._scan_head(data)
        super().receive_data(data)

    def next_event(self) -> Any:
        if self._error is not None:
            raise FramingError(self._error)
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                raise FramingError(
                    "a request must not have both Content-Length and Transfer-Encoding"
                )
        return event

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._head, self._is_head_read = b"", False

    def _scan_head(self, data: bytes) -> None:
        head = self._head + data[: self._max_incomplete_event_size]
        end = head.find(_END_OF_HEAD)
        if end >= 0:
            head, self._is_head_read = head[: end + 2], True
        # Every LF of the head must follow a CR; a lone CR at the end may still get its LF.
        if head.count(b"\n") != head.count(b"\r\n"):
            self._error = "request lines must end with CRLF, not a bare LF"
        self._head = head[-self._max_incomplete_event_size :] if not self._is_head_read else b""


class _QuietWarnings:
    """uvicorn's protocol logger with its warnings (a malformed request: "Invalid HTTP
    request received.", one per connection a client opens) logged as
    `http.protocol_warning` at most once a second; everything else as it was."""

    def __init__(self, logger: logging.Logger, log: RateLimitedLog) -> None:
        self._logger = logger
        self._log = log

    def warning(self, message: str, *args: Any, **kwargs: Any) -> None:
        text = message % args if args else message
        self._log.log(logging.WARNING, "http.protocol_warning", warning=text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


class ClientReader:
    """How far one connection's client is behind in reading what the server wrote."""

    def __init__(self, protocol: GuardedH11Protocol) -> None:
        self._protocol = protocol
        sock = protocol.transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1

    def unsent_bytes(self) -> int:
        """Bytes written for this client that wait because it does not take them: the
        transport's buffer and the kernel's unsent send queue (0 once the socket closed)."""
        transport = self._protocol.transport
        if transport.is_closing() or self._fd < 0:
            return 0
        try:
            queued = fcntl.ioctl(self._fd, SIOCOUTQNSD, b"\0\0\0\0")
        except OSError:
            return 0
        return transport.get_write_buffer_size() + int(struct.unpack("i", queued)[0])

    @property
    def is_behind(self) -> bool:
        return self.unsent_bytes() > self._protocol.table.limits.slow_reader_bytes

    async def caught_up(self) -> bool:
        """Wait until the client has taken every unsent byte: True; False when it did not
        within `stream_write_timeout` (the connection is then aborted as `write_stalled`)
        or the connection closed."""
        protocol = self._protocol
        deadline = time.monotonic() + protocol.table.limits.stream_write_timeout
        delay = READER_POLL_MIN_S
        while self.unsent_bytes() > 0:
            if time.monotonic() > deadline:
                protocol.write_stalled()
                return False
            await asyncio.sleep(delay)
            delay = min(2 * delay, READER_POLL_MAX_S)
        return not protocol.transport.is_closing()


class ConnectionTable:
    """The open connections of one server, oldest first, and what happened to them."""

    def __init__(self, limits: ServerLimits, metrics: EngineMetrics) -> None:
        self.limits = limits
        self.metrics = metrics
        self.log = RateLimitedLog(logger)
        self.open: dict[GuardedH11Protocol, None] = {}
        self.num_refusing = 0  # refused connections still reading their request

    def closed(self, reason: ConnectionCloseReason, protocol: GuardedH11Protocol) -> None:
        self.metrics.on_connection_closed(reason)
        self.log.log(logging.WARNING, f"http.connection_{reason}", client=_peer(protocol))

    def admit(self, protocol: GuardedH11Protocol) -> bool:
        """Register `protocol`; False when it must be refused (every slot is busy)."""
        self.open[protocol] = None
        if len(self.open) <= self.limits.max_connections:
            return True
        for other in self.open:
            if other is not protocol and other.is_idle and not other.transport.is_closing():
                other.close_idle()
                return True
        return False

    def remove(self, protocol: GuardedH11Protocol) -> None:
        self.open.pop(protocol, None)


def protocol_class(table: ConnectionTable) -> type[GuardedH11Protocol]:
    """uvicorn's `http=` protocol class for one server, bound to its connection table;
    raises `InternalsChanged` when uvicorn or h11 lack what the class relies on."""
    uvicorn_internals.check()
    return type("ServerH11Protocol", (GuardedH11Protocol,), {"table": table})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection limit, a request read deadline and a write
    stall deadline (see the module docstring)."""

    table: ClassVar[ConnectionTable]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        max_size = self.config.h11_max_incomplete_event_size
        self.conn = StrictConnection(max_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.logger = _QuietWarnings(self.logger, self.table.log)  # type: ignore[assignment]
        self._read_timer: asyncio.TimerHandle | None = None
        self._read_cycle: object = None  # the cycle that was current when the timer was set
        self._has_data = False
        self._stall_timer: asyncio.TimerHandle | None = None
        self._is_refused = False

    @property
    def is_idle(self) -> bool:
        """No request is being answered on this connection."""
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.table.limits
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
        transport.set_write_buffer_limits(high=limits.write_buffer_bytes)
        if not self.table.admit(self):
            self._refuse()
            return
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._is_refused:
            self.table.num_refusing -= 1
            return
        self.table.remove(self)
        for timer in (self._read_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return  # read and dropped, so that closing does not reset the 503 away
        self._has_data = True
        if self._read_timer is None and self.is_idle:
            self._arm_read_deadline()  # the first bytes of the next request on this connection
        super().data_received(data)

    def handle_events(self) -> None:
        try:
            super().handle_events()
            cycle = self.cycle  # a request's app task runs from the next loop iteration on
            if cycle is not None and CLIENT_READER_KEY not in cycle.scope:
                cycle.scope[CLIENT_READER_KEY] = ClientReader(self)  # type: ignore[literal-required]
        except FramingError as error:
            self._write_raw(400, ErrorCode.INVALID_FRAMING, str(error))
            self.table.closed(ConnectionCloseReason.INVALID_FRAMING, self)
            self.transport.close()

    def on_response_complete(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._has_data = False
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            timeout = self.table.limits.stream_write_timeout
            self._stall_timer = self.loop.call_later(timeout, self.write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def close_idle(self) -> None:
        """Close a connection with no request in progress to make room for a new one."""
        self.table.remove(self)
        self.table.closed(ConnectionCloseReason.EVICTED, self)
        self.transport.close()

    def _arm_read_deadline(self) -> None:
        self._read_cycle = self.cycle
        timeout = self.table.limits.request_read_timeout
        self._read_timer = self.loop.call_later(timeout, self._read_deadline)

    def _read_deadline(self) -> None:
        self._read_timer = None
        cycle = self.cycle
        if cycle is not None and cycle is not self._read_cycle and not cycle.more_body:
            return  # a whole request arrived in time
        if self.transport.is_closing():
            return
        if self._has_data and (cycle is None or not cycle.response_started):
            self._write_raw(408, ErrorCode.REQUEST_TIMEOUT, "the request was not received in time")
        self.table.closed(ConnectionCloseReason.REQUEST_TIMEOUT, self)
        self.transport.close()

    def write_stalled(self) -> None:
        """Abort the connection of a client that did not read for `stream_write_timeout`."""
        self._stall_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None:
            self.cycle.scope[CLIENT_STALLED_KEY] = True  # type: ignore[literal-required]
        self.table.closed(ConnectionCloseReason.WRITE_STALLED, self)
        self.transport.abort()  # close() would wait for the client to read the buffer

    def _refuse(self) -> None:
        """503 and close. The client's request is read and dropped for a moment first (at
        most `max_connections` such connections at once): closing a socket with unread data
        resets it, and the client would not see the 503."""
        table = self.table
        table.remove(self)
        self.connections.discard(self)
        self._is_refused = True
        table.num_refusing += 1
        self._write_raw(
            503,
            ErrorCode.TOO_MANY_CONNECTIONS,
            "the server has too many open connections",
            retry=True,
        )
        table.closed(ConnectionCloseReason.REFUSED, self)
        if table.num_refusing > table.limits.max_connections:
            self.transport.abort()
            return
        self.transport.write_eof()
        self.loop.call_later(REFUSE_LINGER_S, self.transport.abort)

    def _write_raw(self, status: int, code: str, message: str, *, retry: bool = False) -> None:
        """A complete response written below h11 (the connection is closed right after)."""
        kind = UNAVAILABLE if status == HTTPStatus.SERVICE_UNAVAILABLE else INVALID_REQUEST
        error = APIError(status, message, type=kind, code=code)
        body = msgspec.json.encode(error.body())
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n"
            + ("retry-after: 1\r\n" if retry else "")
            + "\r\n"
        )
        self.transport.write(head.encode() + body)


def _peer(protocol: H11Protocol) -> str | None:
    client = protocol.client
    return f"{client[0]}:{client[1]}" if client else None


def rate_limited_exception_handler(log: RateLimitedLog) -> Any:
    """An event-loop exception handler: "socket.accept() out of system resource" and the
    like (one per failed accept, thousands a second when descriptors run out) are logged
    at most once a second; everything else goes to the default handler."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept()"):
            exc = context.get("exception")
            log.log(logging.ERROR, "http.accept_failed", error=repr(exc) if exc else message)
            return
        loop.default_exception_handler(context)

    return handle
