"""Fixtures of the failure matrix: a process watcher, fault injection, and faulty servers.

`ProcessWatch` samples the descendants of a root process every few milliseconds in a thread,
so that even a child that lives for a moment (a worker that fails while loading) is recorded
by pid; at the end the test asserts that every recorded process is gone, and the fixture
kills by pid whatever this test started that is still alive.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import psutil
import pytest

from tests.helpers.procs import ServerProcess, assert_no_children, children_of, is_alive

EXIT_LIMIT_S = 20.0  # from the fault to the server's exit, on a loaded 2-core machine
GONE_LIMIT_S = 5.0  # from the exit (or the raise) to the last child gone


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


@pytest.fixture
def children() -> Iterator[ProcessWatch]:
    """Every process this test starts below the test process (by pid, sampled every 20 ms)."""
    baseline = {p.pid for p in children_of(os.getpid())}
    watch = ProcessWatch(os.getpid(), ignore=baseline)
    yield watch
    watch.kill_leftovers()


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Set OTEL_ENGINE_FAULT for the processes this test spawns (and for in-process engines)."""
    from otel_engine.observability import faults

    def inject(spec: str) -> None:
        monkeypatch.setenv(faults.ENV_VAR, spec)
        monkeypatch.setattr(faults, "_FAULTS", faults.Fault.parse_list(spec))

    return inject


def server_args(model_dir: str, *extra: str) -> list[str]:
    return ["--model", model_dir, "--num-kv-blocks", "256", "--log-level", "INFO", *extra]


@pytest.fixture
def start_server(
    tiny_model_dir: str,
) -> Iterator[Callable[..., tuple[ServerProcess, ProcessWatch]]]:
    """Start `otel-engine serve` on the tiny model with a fault; wait until it is healthy."""
    started: list[tuple[ServerProcess, ProcessWatch]] = []

    def start(
        *args: str,
        fault: str | None = None,
        wait_healthy: bool = True,
        model_dir: str | None = None,
    ) -> tuple[ServerProcess, ProcessWatch]:
        env = {"OTEL_ENGINE_FAULT": fault} if fault else {}
        server = ServerProcess(server_args(model_dir or tiny_model_dir, *args), env=env).start()
        watch = ProcessWatch(server.pid)
        watch.seen[server.pid] = psutil.Process(server.pid)
        started.append((server, watch))
        if wait_healthy:
            server.wait_healthy(timeout=120)
        return server, watch

    yield start
    for server, watch in started:
        watch.kill_leftovers()
        server.cleanup()


def log_time(server: ServerProcess, event: str) -> float | None:
    """time.time() of the first JSON log line of `server` whose event is `event`."""
    for record in server.json_lines():
        if record.get("event") == event and "timestamp" in record:
            return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def wait_exit(server: ServerProcess, timeout: float = EXIT_LIMIT_S) -> int:
    """The server's exit code; fails (with its log) if it is still running after `timeout`."""
    try:
        return server.wait(timeout)
    except Exception as error:
        raise AssertionError(f"server still running after {timeout}s:\n{server.tail()}") from error
