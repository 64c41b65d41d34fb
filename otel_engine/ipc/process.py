"""The spawn trampoline: every child process starts here.

`spawn()` starts a fresh interpreter at `child_main` (: no inherited
threads, locks or tracer providers, no pickle, and callers need no `__main__` guard). The
child reads its target and plain-data arguments as msgpack from stdin, sets its process
title, enables `faulthandler` into the file its parent named (`native_fault`), configures
logging for its role, starts a thread that exits the process when the parent dies (EOF on
the death pipe), and runs its target. The target reports READY through
`ReadyChannel` once it can serve; an exception before that becomes a FAILED message with
the traceback. The parent waits on the handshake pipe and the child's pidfd together, so a
child that dies during startup is noticed at once. A child that dies of a signal is
described by what its faulthandler wrote: "died of SIGSEGV in <function> at <file>:<line>".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from otel_engine.errors import EngineStartupError, FailureCause
from otel_engine.ipc import native_fault
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import (
    EngineLimits,
    ErrorInfo,
    Failed,
    HandshakeMessage,
    MemoryBandwidth,
    Ready,
)
from otel_engine.ipc.native_fault import FaultReport
from otel_engine.ipc.roles import ProcessRole
from otel_engine.timing import TERM_GRACE_S

logger = logging.getLogger(__name__)
_handshake: Codec[HandshakeMessage] = Codec(HandshakeMessage)
PRELOAD_NICE = 19  # a standby's imports: CPU time nobody else wants, nearly


class Launch(msgspec.Struct, frozen=True):
    """What the parent tells a new child on its stdin."""

    name: str
    target: str  # "module:function", called as function(ReadyChannel, *args)
    role: str
    rank: int | None
    ready_fd: int
    death_fd: int
    args: list[Any]
    fault_path: str = ""  # where its faulthandler writes ("": stderr)
    env: dict[str, str] = {}  # set before it sets itself up (a standby's start-specific part)


class ReadyChannel:
    """The child's end of the startup handshake."""

    def __init__(self, fd: int, process_name: str) -> None:
        self._fd = fd
        self.process_name = process_name
        self.sent = False

    def ready(
        self,
        limits: EngineLimits | None = None,
        fast_paths: dict[str, Any] | None = None,
        memory_bandwidth: MemoryBandwidth | None = None,
    ) -> None:
        self._send(
            Ready(
                process=self.process_name,
                pid=os.getpid(),
                limits=limits,
                fast_paths=fast_paths,
                memory_bandwidth=memory_bandwidth,
            )
        )

    def failed(self, exc: BaseException) -> None:
        """Report a startup failure; a grandchild's failure is passed on as it is."""
        if isinstance(exc, EngineStartupError) and exc.failed_process:
            info = ErrorInfo(
                type=exc.cause_type,
                message=exc.cause_message,
                traceback=exc.traceback,
                process=exc.failed_process,
            )
        else:
            info = error_info(exc, self.process_name)
        self._send(Failed(error=info))

    def _send(self, message: HandshakeMessage) -> None:
        if not self.sent:
            self.sent = True
            with os.fdopen(self._fd, "wb") as pipe:
                pipe.write(_handshake.encode(message))


class ChildProcess:
    """A started child: its Popen, pidfd (the death sentinel) and handshake pipe."""

    def __init__(
        self,
        name: str,
        popen: subprocess.Popen[bytes],
        ready_fd: int,
        death_fd: int,
        fault_path: str = "",
        rank: int | None = None,
    ) -> None:
        self.name = name
        self.rank = rank  # a worker's rank (None for the engine core)
        self.popen = popen
        self.fault_path = fault_path
        self.pid = popen.pid
        self._ready_fd = ready_fd
        self._death_fd = death_fd  # held open while we live: EOF tells the child we died
        self.sentinel = os.pidfd_open(popen.pid)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def describe_exit(self) -> str:
        """How it ended: "exited with code 3", "died of SIGSEGV in <function> at <file>:<line>"
        (a signal faulthandler reports), "was killed by signal 9" (one it cannot)."""
        self.join(0.5)
        code = self.exitcode
        if code is None:
            return "is unresponsive"
        fault = self.fault_report()
        if fault is not None:
            return fault.describe()
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def fault_report(self) -> FaultReport | None:
        """The signal and the faulting frames of a child that died of a signal faulthandler
        reports (no frames when it wrote none); None for any other exit, or while alive."""
        code = self.exitcode
        if code is None or code >= 0 or -code not in native_fault.FAULT_SIGNALS:
            return None
        report = native_fault.read_report(self.fault_path) if self.fault_path else None
        name = native_fault.signal_name(-code)  # the exit status's, whatever the file says
        return dataclasses.replace(report, signal=name) if report else FaultReport(name)

    def death_error(self, cause: str, subject: str, process: str) -> ErrorInfo:
        """The error of this child's unreported death: "<subject> <how>", and for a native
        fault its signal, frames and a client-safe location ("died of SIGSEGV in ...")."""
        how = self.describe_exit()
        fault = self.fault_report()
        if fault is None:
            return ErrorInfo(
                type=cause, message=f"{subject} {how}", process=process, rank=self.rank
            )
        return ErrorInfo(
            type=cause,
            message=f"{subject} {how}",
            process=process,
            rank=self.rank,
            location=how,
            signal=fault.signal,
            frames=list(fault.frames),
        )

    def wait_ready(self, deadline: float) -> Ready:
        """Block until READY; raise EngineStartupError on FAILED, death or timeout."""
        data = b""
        while True:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select(
                [self._ready_fd, self.sentinel], [], [], max(0.0, remaining)
            )
            if self._ready_fd in readable:
                chunk = os.read(self._ready_fd, 1 << 16)
                data += chunk
                if chunk:
                    continue
                if data:
                    return self._handshake(data)
            if not readable:
                raise EngineStartupError(
                    f"{self.name} was not ready in time (see --engine-ready-timeout)",
                    failed_process=self.name,
                    cause_type=FailureCause.STARTUP_TIMEOUT,
                    cause_message="not ready in time (see --engine-ready-timeout)",
                )
            if not data or self._ready_fd not in readable:
                how = f"{self.describe_exit()} during startup"
                raise EngineStartupError(
                    f"{self.name} {how}",
                    failed_process=self.name,
                    cause_type=FailureCause.PROCESS_DIED,
                    cause_message=how,
                )

    def _handshake(self, data: bytes) -> Ready:
        message = _handshake.decode(data)
        if isinstance(message, Ready):
            return message
        err = message.error
        raise EngineStartupError(
            f"{err.process or self.name} failed to start: {err.type}: {err.message}",
            failed_process=err.process or self.name,
            traceback=err.traceback,
            cause_type=err.type,
            cause_message=err.message,
        )

    def stop(self, timeout: float) -> None:
        """Wait for a graceful exit, then SIGTERM, then SIGKILL; always reaps."""
        stop_all([self], graceful_s=timeout)

    def close(self) -> None:
        """Release the pidfd; only once nothing waits on it any more."""
        self._close_fd("_ready_fd")
        self._close_fd("_death_fd")
        self._close_fd("sentinel")

    def _close_fd(self, attr: str) -> None:
        fd = getattr(self, attr)
        if fd >= 0:
            setattr(self, attr, -1)
            os.close(fd)


def stop_all(children: list[ChildProcess], graceful_s: float) -> None:
    """Stop children together under one deadline per phase: wait `graceful_s` for them to
    exit on their own, then SIGTERM the rest, then SIGKILL; always reaps them."""
    _wait_all(children, graceful_s)
    for signal_name, send in (("terminate", "terminate"), ("kill", "kill")):
        alive = [c for c in children if c.is_alive()]
        if not alive:
            break
        for child in alive:
            logger.warning(f"child.{signal_name}", extra={"child": child.name})
            getattr(child.popen, send)()
        _wait_all(alive, TERM_GRACE_S)
    for child in children:
        child._close_fd("_ready_fd")


def _wait_all(children: list[ChildProcess], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))


def wait_for_death(children: list[ChildProcess]) -> ChildProcess:
    """Block until one of `children` exits (its pidfd becomes readable); return it."""
    by_fd = {child.sentinel: child for child in children}
    readable, _, _ = select.select(list(by_fd), [], [])
    return by_fd[readable[0]]


ENGINE_CORE = ProcessRole.ENGINE_CORE  # also its name in failure reports


def process_title(role: str, rank: int | None = None) -> str:
    """A child's name and process title, from its role and rank:
    `otel-engine-core`, `otel-worker-{rank}`. Failure reports name a worker by it (the engine
    core, which reports its own failures, by its role)."""
    if role == ProcessRole.WORKER:
        return f"otel-worker-{rank}"
    return f"otel-{role.replace('_', '-')}"


class Standby:
    """A child process started before it is needed: a fresh interpreter that imports the
    modules in `preload` (the slow part of a start: torch and the model code take seconds) on
    a thread at the lowest priority (nice 19), so that it takes almost no CPU time from the
    processes that serve, then waits on its stdin for its `launch`. A parent that keeps one
    ready starts its next child without those seconds, once `is_ready` (preloaded: on a busy
    machine that can take a while). A standby whose parent dies reads EOF and exits quietly;
    one never launched is stopped by `close`."""

    def __init__(self, env: Mapping[str, str] | None = None, preload: Sequence[str] = ()) -> None:
        if not hasattr(os, "pidfd_open"):  # refused before anything is started
            raise OSError("a child process cannot be supervised here: that needs Linux")
        self._ready_r, self._ready_w = os.pipe()
        self._death_r, self._death_w = os.pipe()
        self._preloaded_r, preloaded_w = os.pipe()  # EOF once the child has imported
        self.popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from {__name__} import child_main; child_main()",
                str(preloaded_w),
                *preload,
            ],
            stdin=subprocess.PIPE,
            pass_fds=(self._ready_w, self._death_r, preloaded_w),
            close_fds=True,
            env=None if env is None else dict(env),
        )
        os.close(self._ready_w)  # the child's, under the same numbers
        os.close(self._death_r)
        os.close(preloaded_w)
        self._launched = False

    def is_ready(self) -> bool:
        """Alive, and done importing what it preloads."""
        if self._launched or self.popen.poll() is not None:
            return False
        readable, _, _ = select.select([self._preloaded_r], [], [], 0)
        return bool(readable)

    def launch(
        self,
        target: str,
        *args: Any,
        role: str,
        rank: int | None = None,
        env: Mapping[str, str] | None = None,
        fault_dir: str | None = None,
    ) -> ChildProcess:
        """Run `target` ("module:function") in it as `process_title(role, rank)`, with `env`
        added to its environment; arguments must be plain data. Its faulthandler writes to
        `fault_dir`/fault-<name> (the engine's private IPC directory), or to its stderr."""
        assert not self._launched, "a standby is launched once"
        self._launched = True
        name = process_title(role, rank)
        fault_path = os.path.join(fault_dir, f"fault-{name}") if fault_dir else ""
        launch = Launch(
            name,
            target,
            role,
            rank,
            self._ready_w,
            self._death_r,
            list(args),
            fault_path,
            dict(env or {}),
        )
        os.close(self._preloaded_r)
        stdin = self.popen.stdin
        assert stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died: its ChildProcess says how
            stdin.write(msgspec.msgpack.encode(launch))
            stdin.close()
        return ChildProcess(name, self.popen, self._ready_r, self._death_w, fault_path, rank)

    def close(self) -> None:
        """Stop a standby that was never launched, and reap it."""
        if self._launched:
            return
        self._launched = True
        self.popen.kill()
        self.popen.wait()
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        for fd in (self._ready_r, self._death_w, self._preloaded_r):
            os.close(fd)


def spawn(
    target: str,
    *args: Any,
    role: str,
    rank: int | None = None,
    env: Mapping[str, str] | None = None,
    fault_dir: str | None = None,
) -> ChildProcess:
    """Start `target` ("module:function") as the process `process_title(role, rank)` with
    environment `env` (this process's by default): `Standby.launch` at once."""
    return Standby(env).launch(target, *args, role=role, rank=rank, fault_dir=fault_dir)


def child_main() -> None:
    """Entry point of every child process (see `Standby`); its arguments are the pipe to
    close once preloaded and the modules to import before it reads its launch."""
    _preload(int(sys.argv[1]), sys.argv[2:])
    data = sys.stdin.buffer.read()
    if not data:  # a standby whose parent died before launching it
        os._exit(0)
    launch = msgspec.msgpack.decode(data, type=Launch)
    os.environ.update(launch.env)
    if launch.fault_path:
        native_fault.enable_to_file(launch.fault_path)
    else:
        native_fault.enable_on_stderr()
    channel = ReadyChannel(launch.ready_fd, launch.name)
    try:
        _set_title(launch.name)
        _watch_parent(launch.death_fd)
        from otel_engine.observability.setup import setup_process

        setup_process(role=launch.role, rank=launch.rank)
        module_name, function_name = launch.target.split(":")
        function = getattr(importlib.import_module(module_name), function_name)
        function(channel, *launch.args)
    except BaseException as exc:
        if not channel.sent:
            logger.exception("process.startup_failed", extra={"child": launch.name})
            channel.failed(exc)
            os._exit(1)
        raise


def _preload(done_fd: int, modules: Sequence[str]) -> None:
    """Import `modules` on a thread of the lowest priority (Linux's nice applies to one
    thread: the main thread keeps its own), then close `done_fd`. A module that fails to
    import is imported again by the launch, which then reports it."""

    def load() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PRELOAD_NICE)
        for module in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(module)

    if modules:
        thread = threading.Thread(target=load, name="preload")
        thread.start()
        thread.join()
    os.close(done_fd)


def _set_title(name: str) -> None:
    import setproctitle

    setproctitle.setproctitle(name)


_ORPHAN_CLEANUPS: list[Callable[[], None]] = []


def on_parent_death(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` (quick, no raising) when this child exits because its parent died: what
    the parent would have removed on an orderly stop (the engine core: the IPC directory)."""
    _ORPHAN_CLEANUPS.append(cleanup)


def _watch_parent(death_fd: int) -> None:
    """Exit this process as soon as the parent is gone (EOF on the death pipe)."""

    def watch() -> None:
        while os.read(death_fd, 1):
            pass
        logger.error("parent.died")
        for cleanup in _ORPHAN_CLEANUPS:
            with contextlib.suppress(Exception):
                cleanup()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
