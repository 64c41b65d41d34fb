"""HTTP framing that a proxy and this server could read differently is refused (RFC 9112):
Content-Length with Transfer-Encoding, and bare-LF line endings. Raw sockets against a real
server."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from tests.entrypoints.conftest import Served

pytestmark = pytest.mark.slow  # starts engine processes


def _exchange(served: Served, data: bytes) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; everything until the server closes it (or 5 s),
    and how long that took."""
    started = time.monotonic()
    chunks = []
    with socket.create_connection(("127.0.0.1", int(served.base_url.rsplit(":", 1)[1]))) as sock:
        sock.settimeout(5)
        sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            chunks.append(b"<still open>")
    return b"".join(chunks), time.monotonic() - started


def test_content_length_with_transfer_encoding_is_refused_and_closed(
    served: Served,
) -> None:
    """Round 2, item 9: a request with both Content-Length and Transfer-Encoding is a 400
    `invalid_framing` and the connection is closed: the request smuggled after it is never
    answered (it used to be served, and the connection kept open)."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    smuggled = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + smuggled
    )
    closed = ("otel_engine_http_connections_closed_total", {"reason": "invalid_framing"})
    before = served.metric(closed[0], **closed[1])
    answer, _ = _exchange(served, request)

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"invalid_framing"' in answer
    assert 1 == answer.count(b"HTTP/1.1 ")
    assert not answer.endswith(b"<still open>")
    assert before + 1 == served.metric(closed[0], **closed[1])


@pytest.mark.parametrize(
    "request_head",
    [b"GET /health HTTP/1.1\nHost: x\n\n", b"GET /health HTTP/1.1\r\nHost: x\n\r\n"],
    ids=["all-lf", "one-lf"],
)
def test_bare_lf_line_endings_are_refused_at_once(served: Served, request_head: bytes) -> None:
    """Round 2, item 11: a request head with a bare LF line ending is a 400 and the
    connection is closed at once (not an answer read one way by us and another by a proxy,
    nor a wait for the read deadline)."""
    answer, seconds = _exchange(served, request_head)

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert not answer.endswith(b"<still open>")
    assert seconds < 2


def test_line_feeds_in_a_body_are_not_framing(served: Served) -> None:
    """A CRLF head with a JSON body full of LFs is served as usual."""
    body = b'{\n"prompt": "hi\\n",\n"max_tokens": 2\n}\n'
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    answer, _ = _exchange(served, request)

    assert answer.startswith(b"HTTP/1.1 200 ")


def test_malformed_requests_cannot_fill_the_log(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """50 connections that each send a request h11 cannot parse: uvicorn's warning
    ("Invalid HTTP request received.") becomes `http.protocol_warning`, at most once a
    second, not one line per connection."""
    with caplog.at_level(logging.WARNING):
        answers = [_exchange(served, b"NOT HTTP AT ALL\r\n\r\n")[0] for _ in range(50)]

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert all(a.startswith(b"HTTP/1.1 400 ") for a in answers)
    assert "Invalid HTTP request received." not in warnings
    assert 1 <= warnings.count("http.protocol_warning") <= 3
