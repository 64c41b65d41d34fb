"""Process helpers for tests that start real servers: ports, descendants, and clean teardown.

`ServerProcess` starts `python -m otel_engine.cli serve` in its own session with its output in
a log file, remembers every descendant it has seen (by psutil identity, which survives
re-parenting and is safe against pid reuse), and on exit kills only those processes, then
asserts that none is left. `ProcessWatch` samples the descendants of a root process every
few milliseconds in a thread, so that even a child that lives for a moment (a worker that
fails while loading) is recorded by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil

GONE_LIMIT_S = 5.0  # from the exit (or the raise) to the last child gone


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_logged(command: list[str], log_path: Path, **options: Any) -> subprocess.Popen[bytes]:
    """`command` in its own session (so signals to the test never reach it), stdout and
    stderr in `log_path`, no stdin."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **options,
        )


def children_of(pid: int) -> list[psutil.Process]:
    """Every living descendant of `pid` (recursive); empty when `pid` is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def is_alive(proc: psutil.Process) -> bool:
    """True while the process runs; a zombie counts as gone (it only waits to be reaped)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _as_processes(procs: Iterable[int | psutil.Process]) -> list[psutil.Process]:
    result = []
    for item in procs:
        if isinstance(item, psutil.Process):
            result.append(item)
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            result.append(psutil.Process(item))
    return result


def assert_no_children(procs: Iterable[int | psutil.Process], timeout: float = 5.0) -> None:
    """Wait up to `timeout` s for the given processes (pids or psutil objects) to be gone."""
    pending = _as_processes(procs)
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pending if is_alive(p)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    described = [f"{p.pid} ({_name(p)})" for p in alive]
    assert not alive, f"processes still alive after {timeout}s: {', '.join(described)}"


def title(proc: psutil.Process) -> str:
    """The process title the engine set (`otel-worker-1`), or its name."""
    try:
        cmdline = proc.cmdline()
        name = proc.name()
    except psutil.Error:
        return "?"
    if cmdline and cmdline[0].startswith("otel-"):
        return cmdline[0].split()[0]
    return name


class ProcessWatch:
    """Records every descendant of `root_pid` that appears while it runs (except `ignore`)."""

    def __init__(self, root_pid: int, ignore: set[int] | None = None) -> None:
        self.root_pid = root_pid
        self.ignore = ignore or set()
        self.seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.sample()

    def sample(self) -> list[psutil.Process]:
        found = [p for p in children_of(self.root_pid) if p.pid not in self.ignore]
        for proc in found:
            if "resource_tracker" not in title(proc):
                self.seen.setdefault(proc.pid, proc)
        return found

    def find(self, name: str, timeout: float = 10.0) -> psutil.Process:
        """The living descendant whose title is `name`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.sample():
                if title(proc) == name and is_alive(proc):
                    return proc
            time.sleep(0.05)
        raise AssertionError(f"no {name} among {sorted(map(title, self.seen.values()))}")

    def titles(self) -> set[str]:
        return {title(p) for p in self.seen.values()}

    def assert_all_gone(self, timeout: float = GONE_LIMIT_S) -> None:
        self.stop()
        assert_no_children(list(self.seen.values()), timeout=timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def kill_leftovers(self) -> None:
        self.stop()
        for proc in self.seen.values():
            if is_alive(proc):
                with contextlib.suppress(psutil.Error):
                    proc.kill()


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"


class ServerProcess:
    """`otel-engine serve` as a context manager: start, wait healthy, read logs, clean up.

    Only processes this object started (the server and the descendants it has seen) are ever
    signalled, each by pid.
    """

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        port: int | None = None,
    ) -> None:
        self.args = list(args)
        self.port = port if port is not None else free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="otel-engine-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._popen: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}

    @property
    def command(self) -> list[str]:
        serve = [sys.executable, "-m", "otel_engine.cli", "serve"]
        return [*serve, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    @property
    def pid(self) -> int:
        return self._proc().pid

    @property
    def returncode(self) -> int | None:
        return self._proc().poll()

    def start(self) -> ServerProcess:
        if self._popen is not None:  # a second server would share the port and the log
            raise RuntimeError(f"server already started (pid {self._popen.pid})")
        self._popen = start_logged(self.command, self.log_path, env=self.env)
        self._seen[self._popen.pid] = psutil.Process(self._popen.pid)
        return self

    def descendants(self) -> list[psutil.Process]:
        """Living descendants now; each one seen is remembered for teardown."""
        found = children_of(self.pid)
        for proc in found:
            self._seen.setdefault(proc.pid, proc)
        return found

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Poll GET /health until it answers 200; fail early if the server exits."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.base_url, timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                self.descendants()
                if self.returncode is not None:
                    raise AssertionError(
                        f"server exited with {self.returncode} before healthy:\n{self.tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/health").status_code == 200:
                        self.descendants()
                        return
                time.sleep(0.2)
        raise AssertionError(f"server not healthy after {timeout}s:\n{self.tail()}")

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the server to exit and return its exit code."""
        return self._proc().wait(timeout)

    def lines(self) -> list[str]:
        """The log so far, one string per line."""
        return self.log_path.read_text(errors="replace").splitlines()

    def json_lines(self) -> list[dict[str, Any]]:
        """The log lines that are JSON objects, parsed; other lines are skipped."""
        records = []
        for line in self.lines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.lines()[-num_lines:])

    def terminate(self) -> None:
        """SIGTERM to the server process only."""
        self.descendants()
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the server process only."""
        self.descendants()
        self._signal(signal.SIGKILL)

    def cleanup(self, timeout: float = 5.0) -> None:
        """Kill whatever this object started that is still alive, then assert it is all gone."""
        if self._popen is None:
            return
        if self.returncode is None:
            self.descendants()
        for proc in self._seen.values():
            if is_alive(proc):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)
        assert_no_children(list(self._seen.values()), timeout=timeout)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def _proc(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError("server not started")
        return self._popen

    def __enter__(self) -> ServerProcess:
        return self if self._popen is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self._popen is not None:
            # A failing test shows the server's last words (pytest prints captured stderr).
            print(f"--- server log tail (pid {self.pid}) ---\n{self.tail(80)}", file=sys.stderr)
        self.cleanup()
