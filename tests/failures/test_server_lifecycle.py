"""The server's own life under failure: killed, stopped while loading, given a bad path.

SIGKILL of the api_server must not leave its engine core or workers running (each child
watches its parent); SIGTERM while the engine is still loading is an orderly stop (exit 0,
nothing left); a model path that does not exist fails at once, naming the path.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.failures.conftest import ProcessWatch
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

ORPHAN_LIMIT_S = 5.0
STOP_LIMIT_S = 10.0


def test_sigkill_of_api_server_leaves_no_children(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """SIGKILL of the api_server at TP=2: engine core and both workers exit within 5 s,
    and the server's private IPC directory (its sockets) is gone with them."""
    server, watch = start_server("--tensor-parallel-size", "2")
    ipc_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"otel-engine-{server.pid}-*"))
    assert len(ipc_dirs) == 1
    watch.sample()
    assert {"otel-engine-core", "otel-worker-0", "otel-worker-1"} <= watch.titles()
    watch.stop()

    killed_at = time.monotonic()
    server.kill()
    server.wait(5)

    watch.assert_all_gone(ORPHAN_LIMIT_S)
    print(f"children gone {time.monotonic() - killed_at:.2f} s after SIGKILL of the api_server")
    assert not os.path.exists(ipc_dirs[0])


def test_an_idle_engine_core_killed_ends_the_server(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """SIGKILL of the engine core before any request: the server does not keep answering
    /health 200 over a dead engine; it exits 1 with the crash dump, as under load."""
    server, watch = start_server()
    core = watch.find("otel-engine-core")
    killed_at = time.monotonic()
    core.kill()
    assert 1 == server.wait(STOP_LIMIT_S), server.tail()
    print(f"server exited {time.monotonic() - killed_at:.2f} s after SIGKILL of an idle core")
    events = [r.get("event") for r in server.json_lines()]
    assert {"engine_core.died", "engine_crash_dump", "engine.dead"} <= set(events)
    watch.assert_all_gone(ORPHAN_LIMIT_S)


def test_a_worker_that_never_gets_ready_is_the_one_named(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """Worker 1 hangs while loading (TP=2): the start fails at --engine-ready-timeout naming
    otel-worker-1, the engine core's account, not "otel-engine-core was not ready" (the
    front end's own wait, which started first)."""
    server, watch = start_server(
        "--tensor-parallel-size",
        "2",
        "--engine-ready-timeout",
        "8",
        fault="worker:hang:phase=load:rank=1",
        wait_healthy=False,
    )
    assert 1 == server.wait(60), server.tail()
    (line,) = [line for line in server.lines() if line.startswith("otel-engine: error:")]
    assert "otel-worker-1 failed to start: StartupTimeout: not ready in time" in line, line
    watch.assert_all_gone(ORPHAN_LIMIT_S)


def _wait_for_log(server: ServerProcess, event: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("event") == event for r in server.json_lines()):
            return
        assert server.returncode is None, server.tail()
        time.sleep(0.1)
    raise AssertionError(f"no {event} in the log after {timeout}s:\n{server.tail()}")


def test_sigterm_during_load_exits_0_without_orphans(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """SIGTERM while worker 0 is stuck loading (TP=2): an orderly stop, exit code 0 within
    10 s, and no engine core or worker left."""
    server, watch = start_server(
        "--tensor-parallel-size",
        "2",
        "--engine-ready-timeout",
        "120",
        fault="worker:hang:phase=load:rank=0",
        wait_healthy=False,
    )
    _wait_for_log(server, "fault.injected", timeout=60)
    watch.sample()
    assert {"otel-engine-core", "otel-worker-0", "otel-worker-1"} <= watch.titles()

    started = time.monotonic()
    server.terminate()
    code = server.wait(60)
    elapsed = time.monotonic() - started

    print(f"SIGTERM during load: exit {code} after {elapsed:.2f} s")
    assert 0 == code, server.tail()
    watch.assert_all_gone(ORPHAN_LIMIT_S)
    assert elapsed < STOP_LIMIT_S, server.tail()


def test_missing_model_path_fails_fast_naming_the_path(tmp_path: Path) -> None:
    """--model pointing nowhere: non-zero exit within seconds, the path in the error output."""
    missing = str(tmp_path / "no-such-model")
    started = time.monotonic()

    result = subprocess.run(
        [sys.executable, "-m", "otel_engine.cli", "serve", "--port", "0", "--model", missing],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    elapsed = time.monotonic() - started
    print(f"missing model path: exit {result.returncode} after {elapsed:.2f} s")
    assert 0 != result.returncode
    assert elapsed < 15.0
    last_line = result.stderr.strip().splitlines()[-1]
    assert missing in last_line, result.stderr[-2000:]
