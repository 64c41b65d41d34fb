"""The access log: one `http.access` line per request, that no client can fill or read
secrets from.

uvicorn's own access log is off: it wrote the full target (query string included, so an
`?api_key=...` landed in the log) twice per line, for every request, without a limit. Here a
line names the route the request matched (`http_route`, the app's own path template), never
the path the client sent: a path that matches no route (a 404) is logged as null, so neither
a query string nor a secret a client puts in a path reaches the log. Each client address gets
at most `LINES_PER_CLIENT` lines (access lines and the guard's refusals together) per
`INTERVAL_S`; the first line after a suppressed stretch says how many were left out
(`num_suppressed`), as `log_limits.RateLimitedLog` does for lines limited per event.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("otel_engine.access")

LINES_PER_CLIENT = 10
INTERVAL_S = 1.0
# Addresses remembered at once; past it, addresses not seen this interval are forgotten and
# any others share one budget (many addresses cannot buy more lines than this many).
MAX_CLIENTS = 1024
_OTHERS = "others"


class ClientLogBudget:
    """At most `lines` log lines per client address per `interval_s`."""

    def __init__(self, lines: int = LINES_PER_CLIENT, interval_s: float = INTERVAL_S) -> None:
        self.lines = lines
        self.interval_s = interval_s
        self._windows: dict[str, list[float]] = {}  # address -> [start, lines, suppressed]

    def take(self, address: str) -> int | None:
        """The number of lines suppressed since this client's last one when it may log one
        now, else None (and the line counts as suppressed)."""
        now = time.monotonic()
        key = address if address in self._windows else self._room(address, now)
        window = self._windows.setdefault(key, [now, 0, 0])
        if now - window[0] >= self.interval_s:
            window[0], window[1] = now, 0
        if window[1] >= self.lines:
            window[2] += 1
            return None
        window[1] += 1
        suppressed, window[2] = int(window[2]), 0
        return suppressed

    def _room(self, address: str, now: float) -> str:
        """`address`, or the shared key when the table is full of current clients (the
        count a forgotten client had left to report is dropped with it)."""
        if len(self._windows) >= MAX_CLIENTS:
            for stale in [a for a, w in self._windows.items() if now - w[0] >= self.interval_s]:
                del self._windows[stale]
        return address if len(self._windows) < MAX_CLIENTS else _OTHERS

    def log(self, level: int, event: str, address: str, **fields: Any) -> bool:
        """Log `event` for this client if its budget allows; True if it was logged."""
        suppressed = self.take(address)
        if suppressed is None:
            return False
        logging.getLogger("otel_engine.api_server").log(
            level, event, extra={**fields, "num_suppressed": suppressed}
        )
        return True


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class AccessLogMiddleware:
    """Logs `http.access` (method, path, status, duration) when a response starts, inside
    the HTTP span (so the line carries the request's trace), within the client's budget."""

    def __init__(self, app: ASGIApp, budget: ClientLogBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._log(scope, message["status"], started)
            await send(message)

        await self.app(scope, receive, logged_send)

    def _log(self, scope: Scope, status: int, started: float) -> None:
        address = client_address(scope)
        suppressed = self.budget.take(address)
        if suppressed is None:
            return
        logger.info(
            "http.access",
            extra={
                "client_addr": address,
                "http_method": scope["method"][:16],
                "http_route": getattr(scope.get("route"), "path", None),
                "status_code": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 1),
                "num_suppressed": suppressed,
            },
        )
