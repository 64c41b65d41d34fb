"""Every poll interval, grace period and flush bound of the engine, in one place.

The configured timeouts (`TimeoutConfig`: --engine-ready-timeout, --step-timeout,
--shutdown-timeout) are the long waits; everything here is short and fixed, and together
they bound how long a failure takes to reach the clients and the process to exit. The
worst cases are formulas (`hang_to_exit_s`), stated in docs/operations.md and checked by
tests/failures against real servers.
"""

from __future__ import annotations

from typing import NamedTuple

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
# Ray (--distributed-executor-backend ray): after a rank's report, the ranks that said nothing
# are pinged (a living actor answers in milliseconds; a gone node never does), so the cause
# is named at most this much later; a cluster address is first tried with a TCP connection.
RAY_PING_TIMEOUT_S = 3.0
RAY_REACH_TIMEOUT_S = 5.0
FAILED_REPORT_WAIT_S = 1.5  # a rank that exited with code 1 reported first: wait for it
CRASH_FLUSH_S = 1.0  # the crash dump's telemetry flush before EngineDead is sent
# Retry-After of a request refused during the first restart (later ones: the last's duration)
RETRY_AFTER_FIRST_RESTART_S = 5.0
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
# The engine core's own waits for its ranks start after the front end's wait for the core,
# with the same --engine-ready-timeout: the front end waits this much longer, so that the
# core's account of what was not ready (which rank, the placement group) is what is reported.
STARTUP_REPORT_GRACE_S = 5.0
FLUSH_WHEN_FAILING_S = 0.2  # the last flush of a process whose exports already failed
CRASH_FILE_WRITE_S = 1.0  # a --crash-dump-dir file not written by then is given up
CORE_SEND_RETRY_S = 0.05  # a full input queue to a live engine core: look again this often
SERVER_TICK_S = 0.1  # uvicorn's main loop checks for an exit this often
GRACEFUL_HTTP_SHUTDOWN_S = 5  # uvicorn's wait for open connections after the drain
THREAD_JOIN_S = 2.0  # a helper thread (output pump, watchdog) joined at shutdown
MONITOR_JOIN_S = 1.0  # a monitor or responder thread (it looks at its stop flag often)
RESPONDER_POLL_S = 0.2  # a worker's responder thread looks at its stop flag this often
# A process that sends its last frame (EngineDead, a worker's failure, the core's final
# outputs) closes the socket with this linger, so that the frame leaves before the exit; a
# peer that is gone costs at most this long, within the parent's TERM_GRACE_S.
LAST_FRAME_LINGER_S = 2.0
WORKER_EXIT_LINGER_S = 1.0  # a worker's outputs at a clean exit (nothing important pending)
STOP_SEND_TIMEOUT_S = 1.0  # sending StopWorker to a worker's full input queue gives up
GRACEFUL_WORKER_STOP_MAX_S = 10.0  # a clean shutdown waits at most this long for workers
REFUSE_LINGER_S = 0.5  # a refused connection's request is read and dropped this long
# A stream paused for a client that does not read looks at its socket again after the first,
# then twice as long each time up to the second: a client that catches up resumes within
# READER_POLL_MAX_S, and hundreds of paused streams cost the event loop little.
READER_POLL_MIN_S = 0.01
READER_POLL_MAX_S = 0.2


def watchdog_poll_s(timeouts: TimeoutConfig) -> float:
    return min(WATCHDOG_POLL_MAX_S, timeouts.step_timeout / 4)


class Term(NamedTuple):
    """One wait of a worst case: what it is, its formula, its seconds for given timeouts."""

    what: str
    formula: str
    seconds: float


def hang_to_exit_terms(timeouts: TimeoutConfig) -> list[Term]:
    """The waits from the start of a step that hangs to the server's exit, at most (with
    --final-scrape-wait 0), in the order they happen."""
    return [
        Term("the step timeout", "step_timeout", timeouts.step_timeout),
        Term(
            "the watchdog's look",
            f"min({WATCHDOG_POLL_MAX_S:g}, step_timeout / 4)",
            watchdog_poll_s(timeouts),
        ),
        Term(
            "asking the workers where they are, at TP > 1",
            f"{RANK_REPORT_WAIT_S:g}",
            RANK_REPORT_WAIT_S,
        ),
        Term("the crash dump's telemetry flush", f"{CRASH_FLUSH_S:g}", CRASH_FLUSH_S),
        Term("the front end's poll", f"{CORE_OUTPUT_POLL_S:g}", CORE_OUTPUT_POLL_S),
        Term("one server tick", f"{SERVER_TICK_S:g}", SERVER_TICK_S),
        Term(
            "SIGTERM to SIGKILL for a child that does not stop, its sockets' lingers included",
            f"{TERM_GRACE_S:g}",
            TERM_GRACE_S,
        ),
        Term(
            "the last telemetry flush",
            f"min({TELEMETRY_FLUSH_S:g}, shutdown_timeout)",
            min(TELEMETRY_FLUSH_S, timeouts.shutdown_timeout),
        ),
    ]


def hang_to_exit_s(timeouts: TimeoutConfig) -> float:
    """From the start of a step that hangs to the server's exit, at most (with
    --final-scrape-wait 0): the sum of `hang_to_exit_terms`."""
    return sum(term.seconds for term in hang_to_exit_terms(timeouts))


def hang_to_exit_text(example: TimeoutConfig) -> str:
    """The formula in words, as docs/operations.md states it, with its value for `example`."""
    terms = hang_to_exit_terms(example)
    parts = [f"`{terms[0].formula}`"] + [f"`+ {t.formula}` ({t.what})" for t in terms[1:]]
    return (
        " ".join(parts)
        + f": {hang_to_exit_s(example):g} s for `--step-timeout {example.step_timeout:g}`"
        f" and `--shutdown-timeout {example.shutdown_timeout:g}`."
    )


def front_end_ready_s(timeouts: TimeoutConfig) -> float:
    """How long the front end waits for the engine core to be ready before giving up on it."""
    return timeouts.engine_ready_timeout + STARTUP_REPORT_GRACE_S
