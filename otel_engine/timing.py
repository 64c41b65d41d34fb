"""Every poll interval, grace period and flush bound of the engine, in one place.

The configured timeouts (`TimeoutConfig`: --engine-ready-timeout, --step-timeout,
--shutdown-timeout) are the long waits; everything here is short and fixed, and together
they bound how long a failure takes to reach the clients and the process to exit. The
worst cases are formulas (`hang_to_exit_s`), stated in docs/operations.md and checked by
tests/failures against real servers.
"""

from __future__ import annotations

from otel_engine.config import TimeoutConfig

CORE_OUTPUT_POLL_S = 0.1  # the front end waits this long for a frame before checking liveness
WORKER_RESULT_POLL_S = 0.05  # the core waits this long for a worker result between checks
CORE_IDLE_POLL_S = 0.2  # an idle engine core checks its workers' health this often
GRAMMAR_POLL_S = 0.002  # an idle engine core building a grammar checks it this often
WATCHDOG_POLL_MAX_S = 0.5  # the step watchdog looks at least this often (or timeout / 4)
FAILURE_GRACE_S = 0.3  # after one rank fails, other ranks' reports are collected this long
RANK_REPORT_WAIT_S = (
    0.3  # after a step timeout at TP > 1, every worker has this long to say where it is
)
FAILED_REPORT_WAIT_S = 1.5  # a rank that exited with code 1 reported first: wait for it
CRASH_FLUSH_S = 1.0  # the crash dump's telemetry flush before EngineDead is sent
STALL_GRACE_S = 5.0  # a frozen core (no watchdog report) is given up this much after the timeout
# The engine core's step-watchdog thread sends a heartbeat this often, also while a step runs
# (its main thread computes; the watchdog thread keeps running). The front end reports the
# engine stalled (/health 503) when nothing came from the core for HEARTBEAT_TIMEOUT_S: the
# process is frozen (SIGSTOP, a debugger, a lock held across the whole interpreter). Ten
# missed heartbeats, so a core starved of CPU for a few seconds is no false alarm.
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0
PUBLISH_POLL_S = 0.05  # a worker waiting for rank 0's rendezvous port looks this often
TERM_GRACE_S = 3.0  # SIGTERM to SIGKILL for a child that does not stop
DRAIN_CANCEL_GRACE_S = 5.0  # requests cancelled at the drain deadline send their 503s
# The most each process's clean exit waits for its spans, logs and metrics to leave. A
# reachable collector takes milliseconds; an unreachable or silent one would hold every exit
# for the exporters' retries (10 s each), and workers, engine core and api_server exit in turn.
TELEMETRY_FLUSH_S = 1.0
FLUSH_WHEN_FAILING_S = 0.2  # the last flush of a process whose exports already failed
CRASH_FILE_WRITE_S = 1.0  # a --crash-dump-dir file not written by then is given up
CORE_SEND_RETRY_S = 0.05  # a full input queue to a live engine core: look again this often
SERVER_TICK_S = 0.1  # uvicorn's main loop checks for an exit this often
GRACEFUL_HTTP_SHUTDOWN_S = 5  # uvicorn's wait for open connections after the drain
THREAD_JOIN_S = 2.0  # a helper thread (output pump, watchdog) joined at shutdown


def watchdog_poll_s(timeouts: TimeoutConfig) -> float:
    return min(WATCHDOG_POLL_MAX_S, timeouts.step_timeout / 4)


def hang_to_exit_s(timeouts: TimeoutConfig) -> float:
    """From the start of a step that hangs to the server's exit, at most (with
    --final-scrape-wait 0): the timeout, the watchdog's look, asking the workers where they
    are, the crash flush, the front end's poll, one server tick, stopping a child that
    ignores SIGTERM, and the last telemetry flush."""
    return (
        timeouts.step_timeout
        + watchdog_poll_s(timeouts)
        + RANK_REPORT_WAIT_S
        + CRASH_FLUSH_S
        + CORE_OUTPUT_POLL_S
        + SERVER_TICK_S
        + TERM_GRACE_S
        + min(TELEMETRY_FLUSH_S, timeouts.shutdown_timeout)
    )
