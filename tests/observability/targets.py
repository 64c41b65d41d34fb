"""Process targets for the spawn-trampoline telemetry test (run in spawned children)."""

from __future__ import annotations

import logging

from otel_engine.ipc.process import ReadyChannel
from otel_engine.observability.tracing import extract_context, get_tracer, shutdown_telemetry

logger = logging.getLogger("otel_engine.tests.child")


def traced_child(channel: ReadyChannel, carrier: dict[str, str]) -> None:
    """Report READY, then do one traced unit of work under the parent's span and flush."""
    channel.ready()
    with get_tracer().start_as_current_span("child.work", context=extract_context(carrier)):
        logger.info("child.working", extra={"num_items": 2})
    shutdown_telemetry(10)
