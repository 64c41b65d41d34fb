"""The spawn trampoline: every child process starts here.

`spawn()` starts a child with the `spawn` start method (never fork: no inherited threads,
locks or tracer providers). The child sets its process title, configures logging for its
role, starts a thread that exits the process when the parent dies, and runs its target.
The target reports READY through `ReadyChannel` once it can serve; an exception before
that becomes a FAILED message with the traceback. The parent waits for the handshake and
the child's sentinel together, so a child that dies during startup is noticed at once.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from otel_engine.errors import EngineStartupError
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import Failed, HandshakeMessage, Ready

logger = logging.getLogger(__name__)
_handshake: Codec[HandshakeMessage] = Codec(HandshakeMessage)


class ReadyChannel:
    """The child's end of the startup handshake."""

    def __init__(self, conn: Connection, process_name: str) -> None:
        self._conn = conn
        self.process_name = process_name
        self.sent = False

    def ready(self, **info: int) -> None:
        self._send(Ready(process=self.process_name, pid=os.getpid(), info=info))

    def failed(self, exc: BaseException) -> None:
        self._send(Failed(error=error_info(exc, self.process_name)))

    def _send(self, message: HandshakeMessage) -> None:
        if not self.sent:
            self.sent = True
            self._conn.send_bytes(_handshake.encode(message))
            self._conn.close()


@dataclass
class ChildProcess:
    """A started child and the parent's end of its handshake."""

    name: str
    process: multiprocessing.process.BaseProcess
    conn: Connection

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def wait_ready(self, deadline: float) -> Ready:
        """Block until READY; raise EngineStartupError on FAILED, death or timeout."""
        remaining = deadline - time.monotonic()
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], max(0.0, remaining))
        if self.conn in ready:
            try:
                message = _handshake.decode(self.conn.recv_bytes())
            except EOFError:
                message = None
            if isinstance(message, Ready):
                return message
            if isinstance(message, Failed):
                err = message.error
                raise EngineStartupError(
                    f"{err.process or self.name} failed to start: {err.type}: {err.message}",
                    failed_process=err.process or self.name,
                    traceback=err.traceback,
                )
        if not ready:
            raise EngineStartupError(
                f"{self.name} was not ready in time (see --engine-ready-timeout)",
                failed_process=self.name,
            )
        self.process.join(1.0)
        raise EngineStartupError(
            f"{self.name} died during startup (exit code {self.process.exitcode})",
            failed_process=self.name,
        )

    def stop(self, timeout: float) -> None:
        """Wait for a graceful exit, then SIGTERM, then SIGKILL; always reaps."""
        process = self.process
        process.join(timeout)
        if process.is_alive():
            logger.warning("child did not exit in time, terminating", extra={"child": self.name})
            process.terminate()
            process.join(min(timeout, 5.0))
        if process.is_alive():
            process.kill()
            process.join(5.0)
        self.conn.close()


def spawn(name: str, target: str, *args: Any, role: str, rank: int | None = None) -> ChildProcess:
    """Start `target` ("module:function") as process `name`; arguments must be plain data."""
    context = multiprocessing.get_context("spawn")
    parent_conn, child_conn = context.Pipe(duplex=False)
    process = context.Process(
        target=_trampoline,
        name=name,
        args=(name, target, role, rank, child_conn, args),
        daemon=False,
    )
    process.start()
    child_conn.close()
    return ChildProcess(name=name, process=process, conn=parent_conn)


def _trampoline(
    name: str, target: str, role: str, rank: int | None, conn: Connection, args: tuple[Any, ...]
) -> None:
    channel = ReadyChannel(conn, name)
    try:
        _set_title(name)
        _watch_parent()
        from otel_engine.observability.setup import setup_process

        setup_process(role=role, rank=rank)
        module_name, function_name = target.split(":")
        function = getattr(importlib.import_module(module_name), function_name)
        function(channel, *args)
    except BaseException as exc:
        if not channel.sent:
            logger.exception("process.startup_failed", extra={"child": name})
            channel.failed(exc)
            os._exit(1)
        raise


def _set_title(name: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(name)
    except ImportError:
        pass


def _watch_parent() -> None:
    """Exit this process as soon as the parent is gone (its sentinel pipe closes)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("parent.died", extra={"parent_pid": parent.pid})
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
