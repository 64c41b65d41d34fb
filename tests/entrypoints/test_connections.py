"""Connections cost the server a bounded amount: a limit, deadlines, quiet logs, and a 500
that keeps the connection usable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from otel_engine.entrypoints.network.connections import rate_limited_exception_handler
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.observability.log_limits import RateLimitedLog
from tests.entrypoints.conftest import Served, ServerLoop

pytestmark = pytest.mark.slow  # starts servers or engine processes

READ_TIMEOUT_S = 1.0


def _serve(server_loop: ServerLoop, engine: AsyncLLM, **limits: float) -> Served:
    server = make_server(engine, drain_timeout=5, limits=ServerLimits(**limits))  # type: ignore[arg-type]
    return Served(server_loop.start(server), engine, server)


@pytest.fixture(scope="module")
def limited(server_loop: ServerLoop, engine: AsyncLLM) -> Iterator[Served]:
    """A server with 8 connections at most and a 1 s request read deadline."""
    served = _serve(server_loop, engine, max_connections=8, request_read_timeout=READ_TIMEOUT_S)
    yield served
    server_loop.stop(served.server)


def _connect(served: Served, rcvbuf: int | None = None) -> socket.socket:
    host, port = served.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _body(response: bytes) -> dict[str, object]:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])  # type: ignore[no-any-return]


def test_silent_connections_are_closed_after_the_read_deadline(limited: Served) -> None:
    """Item 5: connections that never send a byte are closed within the deadline, quietly."""
    socks = [_connect(limited) for _ in range(5)]
    started = time.monotonic()

    received = [_read_all(sock) for sock in socks]
    elapsed = time.monotonic() - started

    assert [b""] * 5 == received
    assert elapsed < READ_TIMEOUT_S + 1.0
    for sock in socks:
        sock.close()


@pytest.mark.parametrize(
    "partial",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never end
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt":',  # body never ends
    ],
)
def test_slow_requests_get_408_after_the_read_deadline(limited: Served, partial: bytes) -> None:
    """Item 5: a request that does not arrive whole in time is answered 408 and closed."""
    before = limited.metric("otel_engine_http_connections_closed_total", reason="request_timeout")
    with _connect(limited) as sock:
        sock.sendall(partial)
        started = time.monotonic()
        response = _read_all(sock)

    assert 408 == _status(response)
    assert {"code": "request_timeout"}.items() <= _body(response)["error"].items()  # type: ignore[union-attr]
    assert time.monotonic() - started < READ_TIMEOUT_S + 1.0
    assert before + 1 == limited.metric(
        "otel_engine_http_connections_closed_total", reason="request_timeout"
    )


def test_a_new_client_evicts_an_idle_connection_at_the_limit(limited: Served) -> None:
    """Item 5: with every slot held by idle connections, a new client is still served: the
    oldest idle connection is closed for it."""
    idle = [_connect(limited) for _ in range(8)]
    time.sleep(0.1)

    with limited.http() as client:
        assert 200 == client.get("/health").status_code

    closed = 0
    for sock in idle:
        sock.settimeout(READ_TIMEOUT_S / 4)
        with contextlib.suppress(TimeoutError):
            closed += sock.recv(1) == b""
        sock.close()
    assert closed >= 1


def test_busy_connections_at_the_limit_refuse_new_ones_with_503(
    server_loop: ServerLoop, engine: AsyncLLM
) -> None:
    """Item 5: when every connection has a request in progress, a new one gets 503
    too_many_connections with `Connection: close`, and the server serves again after."""
    served = _serve(server_loop, engine, max_connections=2)
    body = json.dumps({"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True})
    busy = [_connect(served, rcvbuf=4096) for _ in range(2)]
    for sock in busy:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body.encode()
        )
        sock.recv(1)  # its response has started
    try:
        with _connect(served) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = _read_all(extra)
    finally:
        for sock in busy:
            sock.close()

    assert 503 == _status(response)
    assert b"connection: close" in response.lower()
    assert "too_many_connections" == _body(response)["error"]["code"]  # type: ignore[index]
    deadline = time.monotonic() + 5
    while engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    with served.http() as client:
        assert 200 == client.get("/health").status_code
    server_loop.stop(served.server)


def test_a_connection_flood_stays_within_the_limit(
    limited: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 5: 1,000 connections at once: the server keeps at most its limit open, /health is
    served meanwhile, and closing them logs a line a second, not a line a connection."""
    caplog.set_level(logging.WARNING, logger="otel_engine.api_server")
    started = time.monotonic()
    flood = [_connect(limited) for _ in range(1000)]
    try:
        with limited.http() as client:
            assert 200 == client.get("/health").status_code
        open_now = limited.metric("otel_engine_http_connections")
    finally:
        for sock in flood:
            sock.close()
    elapsed = time.monotonic() - started

    assert open_now <= 8
    lines = [r for r in caplog.records if r.getMessage().startswith("http.connection_")]
    assert len(lines) <= 2 * (elapsed + 1)


def test_accept_errors_are_logged_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    """Item 5: "socket.accept() out of system resource", which asyncio reports once per
    failed accept, is logged at most once a second, with the count it left out."""
    caplog.set_level(logging.ERROR, logger="otel_engine.api_server")
    loop = asyncio.new_event_loop()
    log = RateLimitedLog(logging.getLogger("otel_engine.api_server"), interval_s=1.0)
    handler = rate_limited_exception_handler(log)
    error = OSError(24, "Too many open files")
    try:
        for _ in range(1000):
            handler(loop, {"message": "socket.accept() out of system resource", "exception": error})
        time.sleep(1.05)
        handler(loop, {"message": "socket.accept() out of system resource", "exception": error})
    finally:
        loop.close()

    lines = [r for r in caplog.records if r.getMessage() == "http.accept_failed"]
    assert [0, 999] == [r.num_suppressed for r in lines]  # type: ignore[attr-defined]


def test_unexpected_error_is_a_500_that_keeps_the_connection(
    server_loop: ServerLoop, engine: AsyncLLM
) -> None:
    """Item 7: an unexpected exception answers 500 with an OpenAI-style body, and the same
    keep-alive connection serves the next request."""
    served = _serve(server_loop, engine)
    app = served.server.config.app
    assert isinstance(app, FastAPI)

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/broken", broken, methods=["GET"])
    with _connect(served) as sock:
        sock.sendall(b"GET /v1/broken HTTP/1.1\r\nHost: x\r\n\r\n")
        first = _read_response(sock)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        second = _read_response(sock)

    assert 500 == _status(first)
    assert b"connection: close" not in first.lower()
    assert "internal_server_error" == _body(first)["error"]["type"]  # type: ignore[index]
    assert 200 == _status(second)
    server_loop.stop(served.server)


def test_repeated_500s_log_one_traceback_a_second_and_count_the_rest(
    server_loop: ServerLoop, engine: AsyncLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 3, item 4: 300 requests that hit the same bug in well under a second log one
    `request.internal_error` line with its traceback, the client's budget of `request.failed`
    lines (10 a second), and every one of them in the errors metric; the next traceback, a
    second later, counts the ones left out."""
    served = _serve(server_loop, engine)
    app = served.server.config.app
    assert isinstance(app, FastAPI)
    fresh = RateLimitedLog(logging.getLogger("otel_engine.api_server"))
    errors_before = served.metric(
        "otel_engine_request_errors_total", error_type="internal_server_error"
    )

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/broken", broken, methods=["GET"])
    caplog.set_level(logging.INFO, logger="otel_engine.api_server")
    with pytest.MonkeyPatch.context() as patch, served.http() as client:
        patch.setattr("otel_engine.entrypoints.network.errors._INTERNAL_ERRORS", fresh)
        started = time.monotonic()
        statuses = {client.get("/v1/broken").status_code for _ in range(300)}
        burst_s = time.monotonic() - started
        time.sleep(1.05)
        client.get("/v1/broken")
    errors = served.metric("otel_engine_request_errors_total", error_type="internal_server_error")
    server_loop.stop(served.server)

    tracebacks = [r for r in caplog.records if r.getMessage() == "request.internal_error"]
    failed = [r for r in caplog.records if r.getMessage() == "request.failed"]
    assert {500} == statuses
    assert len(tracebacks) <= 2 + burst_s
    assert all(r.exc_info for r in tracebacks)
    assert 301 == len(tracebacks) + sum(r.num_suppressed for r in tracebacks)  # type: ignore[attr-defined]
    assert len(failed) <= 10 * (2 + burst_s)
    assert 301 == errors - errors_before


def test_refusals_the_servers_state_causes_are_logged_every_time(
    server_loop: ServerLoop, engine: AsyncLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """A 503 with a code (the engine is not serving) before admission is the server's state,
    not the client's to repeat: each gets its `request.failed` line, past the client's
    budget (the chaos ledger holds one line per request)."""
    from otel_engine.entrypoints.network.errors import engine_unavailable

    served = _serve(server_loop, engine)
    app = served.server.config.app
    assert isinstance(app, FastAPI)

    async def unavailable() -> None:
        raise engine_unavailable(None)

    app.add_api_route("/v1/unavailable", unavailable, methods=["GET"])
    caplog.set_level(logging.INFO, logger="otel_engine.api_server")
    with served.http() as client:
        statuses = {client.get("/v1/unavailable").status_code for _ in range(30)}
    server_loop.stop(served.server)

    failed = [r for r in caplog.records if r.getMessage() == "request.failed"]
    assert {503} == statuses
    assert 30 == len(failed)


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body
