"""`RequestStream`: one in-flight request of `AsyncLLM` as its consumer sees it, the outputs
not yet taken and the pause state of backpressure; the restarter (engine/restarter.py)
carries streams over to a new engine core."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry import trace

from otel_engine.outputs import RequestOutput

MAX_UNDELIVERED_OUTPUTS = 32  # outputs waiting for their consumer before the request pauses
RESUME_BELOW_OUTPUTS = 8  # the consumer caught up: the request runs again


@dataclass(slots=True, eq=False)
class RequestStream:
    """One request's undelivered outputs (or the error that ends it) and its pause state."""

    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    is_paused: bool = False
    is_held: bool = False  # paused by its consumer (`AsyncLLM.hold`)
    span: trace.Span | None = None  # the request's span, for a restart's event and link
    crashed_at: float | None = None  # carried over: when its engine failed, until a token

    @property
    def may_resume(self) -> bool:
        return not self.is_held and self.queue.qsize() < RESUME_BELOW_OUTPUTS
