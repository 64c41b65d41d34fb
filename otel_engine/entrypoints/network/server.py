"""The HTTP server around one ASGI app: uvicorn, its listening socket and its descriptors.

`ApiServer` adds to uvicorn what an inference server needs: a drain period on SIGTERM (new
requests get 503, in-flight ones finish or get 503 at the deadline), connections held to the
server's limits (connections.py), and an exit with code 1 once the engine is dead. The socket
is bound before the engine starts (`bind_socket`), so a busy port fails first, and the
connection limit fits the process's descriptor limit (`fit_connection_limit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import socket
import time
from typing import TYPE_CHECKING

import uvicorn

from otel_engine.entrypoints.network.connections import (
    ConnectionTable,
    protocol_class,
    rate_limited_exception_handler,
)
from otel_engine.entrypoints.network.guard import ServerState
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.memory import freeze_startup_objects
from otel_engine.observability.label_sets import HealthState
from otel_engine.timing import GRACEFUL_HTTP_SHUTDOWN_S

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger("otel_engine.api_server")

# Descriptors the process needs besides client connections (IPC, logs, pipes, the listener).
RESERVED_FDS = 256


class ApiServer(uvicorn.Server):
    """uvicorn serving `app` plus a drain on shutdown and an exit once the engine is dead.

    With `final_scrape_wait` > 0 the exit after an engine death waits (at most that long) for
    one GET /metrics that shows the failure, so a Prometheus that scrapes every 15 s still
    records the dead state and the requests the death failed before the process is gone.
    """

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        *,
        drain_timeout: float,
        exit_on_engine_death: bool = True,
        final_scrape_wait: float = 0.0,
    ) -> None:
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,  # access_log.py writes it, without query strings, rate-limited
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_HTTP_SHUTDOWN_S,
            timeout_keep_alive=state.limits.keep_alive_timeout,
        )
        super().__init__(config)
        self.state = state
        self.connections = ConnectionTable(state.limits, state.metrics)
        config.http = protocol_class(self.connections)
        state.metrics.connections_open.set_function(lambda: len(self.connections.open))
        state.metrics.frontend_requests.set_function(lambda: state.engine.num_tracked)
        self.drain_timeout = drain_timeout
        self.exit_on_engine_death = exit_on_engine_death
        self.final_scrape_wait = final_scrape_wait
        self.exit_code = 0
        self._exit_deadline = 0.0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        freeze_startup_objects()
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(rate_limited_exception_handler(self.connections.log))
        await super().startup(sockets)
        if self.started:
            self.state.update_health()
            logger.info("server.listening", extra={"address": _address(self, sockets)})

    async def on_tick(self, counter: int) -> bool:
        if self.state.engine.is_dead and self.exit_code == 0:
            error = self.state.engine.dead_error
            logger.error(
                "server.engine_dead",
                extra={
                    "cause_type": error.cause_type if error else None,
                    "failed_process": error.failed_process if error else None,
                },
            )
            self.state.metrics.set_health(HealthState.DEAD)
            self.exit_code = 1
            self._exit_deadline = time.monotonic() + self.final_scrape_wait
            if self.final_scrape_wait > 0 and self.exit_on_engine_death:
                logger.info("server.final_scrape_wait", extra={"timeout_s": self.final_scrape_wait})
        if self.exit_code and self.exit_on_engine_death and not self.should_exit:
            self.should_exit = self.state.is_dead_scraped or time.monotonic() >= self._exit_deadline
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutdown.begin", extra={"num_in_flight": self.state.num_in_flight})
        await self.state.drain(self.drain_timeout)
        await super().shutdown(sockets)
        for close in self.state.on_shutdown:
            close()


def _address(server: uvicorn.Server, sockets: list[socket.socket] | None) -> str:
    for sock in sockets or [s for srv in server.servers for s in (srv.sockets or ())]:
        host, port = sock.getsockname()[:2]
        return f"{host}:{port}"
    return ""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (but do not listen) early, so a busy port fails before the engine starts."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def fit_connection_limit(limits: ServerLimits) -> ServerLimits:
    """Raise this process's descriptor limit to its hard limit, and lower the connection
    limit (with a warning) if even that cannot hold it: connections are refused with a 503
    before descriptors run out, never by a failing accept()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    room = soft - RESERVED_FDS
    if limits.max_connections <= room:
        return limits
    allowed = max(1, room)
    logger.warning(
        "server.max_connections_lowered",
        extra={"max_connections": allowed, "requested": limits.max_connections, "fd_limit": soft},
    )
    return dataclasses.replace(limits, max_connections=allowed)
