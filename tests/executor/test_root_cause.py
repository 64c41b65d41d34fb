"""The executor's judgement of a failure: which worker caused it, and a worker's death as the
monitor reports it. Pure functions and real child processes; no model."""

from __future__ import annotations

import time

import pytest

from otel_engine.errors import FailureCause
from otel_engine.executor.channel import choose_root_cause, expects_report
from otel_engine.executor.executor import worker_death
from otel_engine.ipc.messages import ErrorInfo, WorkerFailure
from otel_engine.ipc.process import ChildProcess, spawn
from otel_engine.timing import FAILED_REPORT_WAIT_S

DIED = ErrorInfo(
    type=FailureCause.WORKER_DIED,
    message="otel-worker-1 was killed by signal 9",
    process="otel-worker-1",
)
FIRST_SEEN = ErrorInfo(type="RuntimeError", message="seen first", process="otel-worker-0")


def report(rank: int, failed_at: float, message: str = "boom") -> WorkerFailure:
    error = ErrorInfo(type="RuntimeError", message=message, process=f"otel-worker-{rank}")
    return WorkerFailure(rank=rank, error=error, failed_at=failed_at)


def test_a_silent_death_is_the_cause_of_its_peers_reports() -> None:
    """Rank 1 was killed; rank 0's collective then failed and reported: rank 1 is the cause."""
    assert DIED == choose_root_cause(DIED, [report(0, 1.0, "gloo: connection closed")], FIRST_SEEN)


def test_a_worker_that_reported_before_dying_is_judged_by_the_reports() -> None:
    """A worker that raised reports, then exits 1: the earliest report is the cause."""
    own = report(1, 2.0, "its own exception")

    assert own.error == choose_root_cause(DIED, [report(0, 2.5), own], FIRST_SEEN)


def test_the_earliest_report_wins() -> None:
    """Two reports without a death: the one that failed first."""
    assert report(1, 1.0).error == choose_root_cause(
        None, [report(0, 1.5), report(1, 1.0)], FIRST_SEEN
    )


def test_nothing_else_known_keeps_what_was_seen_first() -> None:
    assert FIRST_SEEN == choose_root_cause(None, [], FIRST_SEEN)


@pytest.mark.parametrize(
    ("code", "reporters", "waited", "expected"),
    [
        (1, [], 0.0, True),  # exit 1 is how a worker that raised ends: its report may follow
        (1, [], FAILED_REPORT_WAIT_S + 0.1, False),  # but not for ever
        (1, [1], 0.0, False),  # it has reported
        (-9, [], 0.0, False),  # killed: it never reports
    ],
)
def test_a_report_is_awaited_only_from_a_worker_that_exited_1_without_one(
    code: int, reporters: list[int], waited: float, expected: bool
) -> None:
    failures = [report(rank, 1.0) for rank in reporters]
    assert expected == expects_report(DIED, code, failures, waited)


def test_the_monitor_names_the_worker_that_exited_and_its_code(started: list[ChildProcess]) -> None:
    """Of two workers, the one that exits is reported as WorkerDied with its exit code."""
    for rank, target in enumerate(("ready_and_wait", "ready_then_exit")):
        args = (7,) if target == "ready_then_exit" else ()
        started.append(
            spawn(
                f"tests.ipc.targets:{target}",
                *args,
                role="worker",
                rank=rank,
            )
        )
    for child in started:
        child.wait_ready(time.monotonic() + 30)

    info, code = worker_death(started)

    assert (FailureCause.WORKER_DIED, "otel-worker-1", 7) == (info.type, info.process, code)
    assert "otel-worker-1 exited with code 7" == info.message


def test_the_monitor_reports_a_killed_worker_by_its_signal(started: list[ChildProcess]) -> None:
    started.append(spawn("tests.ipc.targets:ready_and_wait", role="worker", rank=0))
    started[0].wait_ready(time.monotonic() + 30)
    started[0].kill()

    info, code = worker_death(started)

    assert (-9, "otel-worker-0 was killed by signal 9") == (code, info.message)
