"""Log lines a client can cause over and over, limited: at most one line of an event per
interval, the next one saying how many were left out (`num_suppressed`).

Used for the lines whose rate a client, not the server, decides: uvicorn's warnings about
malformed requests, failed accepts, unexpected errors (each with a traceback of a few
kilobytes), streams paused because their client reads slowly, ignored request fields. The
lines a single request causes before it is admitted are limited per client instead
(`access_log.ClientLogBudget`).
"""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """At most one log line per `interval_s` for each event on `logger`; the next line of
    an event says how many of it were left out (`num_suppressed`)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(
        self, level: int, event: str, *, exc_info: BaseException | None = None, **fields: Any
    ) -> bool:
        """Log `event` (with `exc_info`'s traceback) unless one was logged less than
        `interval_s` ago; True if it was logged."""
        now = time.monotonic()
        if now - self._last.get(event, -self.interval_s) < self.interval_s:
            self._suppressed[event] = self._suppressed.get(event, 0) + 1
            return False
        self._last[event] = now
        fields["num_suppressed"] = self._suppressed.pop(event, 0)
        self.logger.log(level, event, exc_info=exc_info, extra=fields)
        return True
