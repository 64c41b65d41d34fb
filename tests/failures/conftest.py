"""Fixtures of the failure matrix: a process watcher, fault injection, and faulty servers.

`ProcessWatch` (tests/helpers/procs.py) records every process a test starts; at the end the
test asserts that every recorded process is gone, and the fixture kills by pid whatever this
test started that is still alive.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import datetime

import psutil
import pytest

from tests.helpers.procs import GONE_LIMIT_S, ProcessWatch, ServerProcess, children_of, title

# imported from here by the failure tests
__all__ = ["GONE_LIMIT_S", "ProcessWatch", "title"]

EXIT_LIMIT_S = 20.0  # from the fault to the server's exit, on a loaded 2-core machine


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
