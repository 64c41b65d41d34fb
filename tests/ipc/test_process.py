"""The spawn trampoline: the READY/FAILED handshake, the death pipe, stopping children."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from otel_engine.errors import EngineStartupError
from otel_engine.ipc.process import (
    PRELOAD_NICE,
    ChildProcess,
    Standby,
    process_title,
    spawn,
    stop_all,
    wait_for_death,
)

TARGETS = "tests.ipc.targets"


def _spawn(started: list[ChildProcess], target: str, rank: int = 3) -> ChildProcess:
    child = spawn(f"{TARGETS}:{target}", role="worker", rank=rank)
    started.append(child)
    return child


def test_ready_child_says_who_it_is(started: list[ChildProcess]) -> None:
    """READY carries the child's name and pid."""
    child = _spawn(started, "ready_and_wait")

    ready = child.wait_ready(time.monotonic() + 30)

    assert ("otel-worker-3", child.pid) == (ready.process, ready.pid)
    assert ready.limits is None


def test_failing_child_reports_its_exception(started: list[ChildProcess]) -> None:
    """An exception while starting arrives as EngineStartupError naming the cause, with the
    child's traceback."""
    child = _spawn(started, "fail_while_starting")

    with pytest.raises(EngineStartupError) as info:
        child.wait_ready(time.monotonic() + 30)

    assert ("ValueError", "bad weights") == (info.value.cause_type, info.value.cause_message)
    assert "otel-worker-3" == info.value.failed_process
    assert "Traceback" in info.value.traceback


def test_child_dying_silently_while_starting_is_process_died(
    started: list[ChildProcess],
) -> None:
    """A child that exits before its handshake: ProcessDied, with the exit code."""
    child = _spawn(started, "die_while_starting")

    with pytest.raises(EngineStartupError) as info:
        child.wait_ready(time.monotonic() + 30)

    assert "ProcessDied" == info.value.cause_type
    assert "3" in info.value.message


def test_child_not_ready_in_time_is_a_startup_timeout(started: list[ChildProcess]) -> None:
    """No handshake before the deadline: StartupTimeout."""
    child = _spawn(started, "never_ready")

    with pytest.raises(EngineStartupError) as info:
        child.wait_ready(time.monotonic() + 1.0)

    assert "StartupTimeout" == info.value.cause_type


def test_child_exits_when_its_parent_end_of_the_death_pipe_closes(
    started: list[ChildProcess],
) -> None:
    """The death pipe: when the parent's end closes (the parent died), the child exits."""
    child = _spawn(started, "ready_and_wait")
    child.wait_ready(time.monotonic() + 30)

    child._close_fd("_death_fd")
    child.join(5.0)

    assert child.exitcode is not None


def test_stop_all_escalates_to_sigkill(started: list[ChildProcess]) -> None:
    """A child that ignores SIGTERM is SIGKILLed; one that honours it exits on SIGTERM."""
    stubborn = _spawn(started, "ready_and_ignore_sigterm", rank=0)
    polite = _spawn(started, "ready_and_wait", rank=1)
    for child in (stubborn, polite):
        child.wait_ready(time.monotonic() + 30)

    stop_all([stubborn, polite], graceful_s=0.0)

    assert -9 == stubborn.exitcode
    assert -15 == polite.exitcode


def test_wait_for_death_names_the_child_that_died(started: list[ChildProcess]) -> None:
    """The pidfd sentinel wakes the watcher for the child that exited, not the others."""
    alive = _spawn(started, "ready_and_wait", rank=0)
    dying = _spawn(started, "ready_and_wait", rank=1)
    for child in (alive, dying):
        child.wait_ready(time.monotonic() + 30)

    dying.kill()

    assert dying is wait_for_death([alive, dying])


@pytest.mark.parametrize(
    ("role", "rank", "title"),
    [
        ("engine_core", None, "otel-engine-core"),
        ("worker", 0, "otel-worker-0"),
        ("worker", 7, "otel-worker-7"),
    ],
)
def test_process_title_comes_from_role_and_rank(role: str, rank: int | None, title: str) -> None:
    """One vocabulary: the process titles, derived from the role and rank."""
    assert title == process_title(role, rank)


def test_without_pidfd_nothing_is_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Linux (no pidfd_open) `spawn` refuses before it starts a process: a child it
    could not supervise is never left behind."""
    import subprocess

    from otel_engine.ipc import process

    started: list[object] = []
    monkeypatch.delattr(process.os, "pidfd_open")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))

    with pytest.raises(OSError, match="needs Linux"):
        process.spawn("tests.ipc.targets:ready_and_wait", role="worker", rank=0)
    assert [] == started


def test_a_standby_imports_ahead_at_the_lowest_priority_then_runs_its_launch(
    started: list[ChildProcess], tmp_path: Path
) -> None:
    """The modules a standby preloads are imported on a thread at nice 19 before its launch;
    the launched target runs on the main thread at the normal priority, with the launch's
    environment."""
    standby = Standby(preload=["tests.ipc.preloaded"])
    _wait_ready(standby)
    report = tmp_path / "start.json"
    child = standby.launch(
        f"{TARGETS}:report_start",
        str(report),
        role="worker",
        rank=5,
        env={"OTEL_ENGINE_TEST_LAUNCH": "yes"},
    )
    started.append(child)

    assert "otel-worker-5" == child.wait_ready(time.monotonic() + 30).process
    facts = json.loads(report.read_text())
    assert {
        "preloaded_by": "preload",
        "preload_nice": PRELOAD_NICE,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "launch_env": "yes",
    } == facts


def test_a_standby_is_ready_only_once_it_has_imported() -> None:
    standby = Standby(preload=["tests.ipc.slow_import"])  # 2 s to import
    try:
        assert not standby.is_ready()
        _wait_ready(standby)
    finally:
        standby.close()
    assert standby.popen.returncode is not None  # close stops one never launched
    assert not standby.is_ready()


def test_a_standby_whose_parent_is_gone_exits_quietly() -> None:
    """A parent that dies closes the standby's stdin: it exits 0 without a launch."""
    standby = Standby()
    assert standby.popen.stdin is not None
    standby.popen.stdin.close()  # what the parent's death does

    assert 0 == standby.popen.wait(30)
    assert not standby.is_ready()
    standby.close()


def _wait_ready(standby: Standby, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not standby.is_ready():
        assert time.monotonic() < deadline, "the standby did not finish its imports"
        time.sleep(0.05)
