"""Failures under the HTTP server: every in-flight client gets its error, the server exits 1.

Each row starts `otel-engine serve` on the tiny model, sends four requests at once (two
streaming, two not), and injects one fault: through `OTEL_ENGINE_FAULT` at step 200 (well
after every request is running, long before any finishes) or by SIGKILL from outside. The
SIGKILL rows first stop the target at step 200 with a `hang` fault and kill it once its log
says so: killed "when the streams flow" instead, a test process starved by the server on two
cores sometimes sent the kill after every request had finished.

Every streaming client must get an SSE error event naming the cause and then the end of the
stream, every other client a 500 naming it; the server must exit with code 1, and every
process it started must be gone within seconds of the exit.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from otel_engine.config import TimeoutConfig
from otel_engine.timing import hang_to_exit_s
from tests.failures.conftest import GONE_LIMIT_S, ProcessWatch, log_time, wait_exit
from tests.failures.crowd import ClientResult, assert_all_failed, run_crowd
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

NUM_CLIENTS = 4
FAULT_STEP = 200  # of 480: every request has joined, none can have finished
DETECTION_LIMIT_S = 5.0  # the contract is 1 s; slack for a loaded 2-core machine
EXIT_AFTER_ERROR_S = 10.0  # the target is 5 s; slack for a loaded 2-core machine
HANG_LOG_LIMIT_S = 20.0  # from the first streamed token to the hang fault's log line


@dataclass(frozen=True)
class Row:
    """One fault: how to inject it and which cause class the clients must see."""

    tp: int
    cause: str
    fault: str | None = None  # OTEL_ENGINE_FAULT
    kill: str | None = None  # title of the process to SIGKILL once the fault stopped it
    args: tuple[str, ...] = ()


ROWS = [
    pytest.param(
        Row(2, "InjectedFault", fault=f"worker:raise:rank=1:step={FAULT_STEP}"),
        id="tp2-worker1-raise",
    ),
    pytest.param(
        Row(2, "WorkerDied", fault=f"worker:exit:rank=0:step={FAULT_STEP}"), id="tp2-worker0-exit"
    ),
    pytest.param(
        Row(
            2,
            "WorkerDied",
            fault=f"worker:hang:rank=1:step={FAULT_STEP}",
            kill="otel-worker-1",
        ),
        id="tp2-worker1-sigkill",
    ),
    pytest.param(
        Row(
            2,
            "StepTimeout",
            fault=f"worker:hang:rank=1:step={FAULT_STEP}",
            args=("--step-timeout", "3"),
        ),
        id="tp2-worker1-hang",
    ),
    pytest.param(
        Row(2, "InjectedOutOfMemoryError", fault=f"worker:oom:rank=1:step={FAULT_STEP}"),
        id="tp2-worker1-oom",
    ),
    pytest.param(
        Row(1, "InjectedFault", fault=f"engine_core:raise:step={FAULT_STEP}"),
        id="tp1-engine-core-raise",
    ),
    pytest.param(
        Row(
            1,
            "EngineCoreDied",
            fault=f"engine_core:hang:step={FAULT_STEP}",
            kill="otel-engine-core",
        ),
        id="tp1-engine-core-sigkill",
    ),
]


def _killer(
    server: ServerProcess, watch: ProcessWatch, name: str, killed_at: list[float]
) -> Callable[[], None]:
    """SIGKILL `name` once the server's log says the fault stopped it mid-run."""
    target = watch.find(name)

    def kill() -> None:
        deadline = time.monotonic() + HANG_LOG_LIMIT_S
        while log_time(server, "fault.injected") is None:
            assert time.monotonic() < deadline, f"no fault.injected logged:\n{server.tail()}"
            time.sleep(0.05)
        killed_at.append(time.time())
        os.kill(target.pid, signal.SIGKILL)

    return kill


def _fault_time(server: ServerProcess, row: Row, killed_at: list[float]) -> float | None:
    return killed_at[0] if killed_at else log_time(server, "fault.injected")


@pytest.mark.parametrize("row", ROWS)
def test_fault_fails_every_client_and_server_exits_1(
    row: Row, start_server: Callable[..., tuple[ServerProcess, ProcessWatch]]
) -> None:
    """Every in-flight client gets its error naming the cause, the server exits 1 and
    leaves no process behind."""
    server, watch = start_server("--tensor-parallel-size", str(row.tp), *row.args, fault=row.fault)
    expected = {"otel-engine-core"} | {f"otel-worker-{r}" for r in range(row.tp) if row.tp > 1}
    watch.sample()
    assert expected <= watch.titles()
    killed_at: list[float] = []
    on_flowing = _killer(server, watch, row.kill, killed_at) if row.kill else None

    results = asyncio.run(run_crowd(server.base_url, NUM_CLIENTS, on_flowing=on_flowing))
    code = wait_exit(server, timeout=60)
    exited_at = time.time()

    _report(row, server, results, _fault_time(server, row, killed_at), exited_at)
    assert_all_failed(results, row.cause)
    assert 1 == code, server.tail()
    watch.assert_all_gone(GONE_LIMIT_S)
    if killed_at:
        assert _last_error(results) - killed_at[0] < DETECTION_LIMIT_S
    assert exited_at - _last_error(results) < EXIT_AFTER_ERROR_S, server.tail()
    if row.cause == "StepTimeout":  # the documented worst case (otel_engine/timing.py)
        step_timeout = float(row.args[row.args.index("--step-timeout") + 1])
        hung_at = log_time(server, "fault.injected")
        assert hung_at is not None
        assert exited_at - hung_at <= hang_to_exit_s(TimeoutConfig(step_timeout=step_timeout))


def _last_error(results: list[ClientResult]) -> float:
    return max(r.ended_at or float("inf") for r in results)


def _report(
    row: Row,
    server: ServerProcess,
    results: list[ClientResult],
    fault_at: float | None,
    exited_at: float,
) -> None:
    if fault_at is None:
        print(f"{row}: no fault time found")
        return
    print(
        f"{row.cause} tp={row.tp}: fault -> last client error "
        f"{_last_error(results) - fault_at:.3f} s, fault -> exit {exited_at - fault_at:.3f} s"
    )
