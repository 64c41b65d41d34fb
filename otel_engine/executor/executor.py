"""Executors: run one step's `ModelInput` and return rank 0's sampled tokens.

`UniprocExecutor` runs the model in the calling process (TP=1). `MultiprocExecutor` drives
`--tensor-parallel-size` worker processes over ZMQ and reports what they did: a worker that
reports a failure, or whose process sentinel fires (killed, OOM), turns the current or next
`execute()` into `WorkerError` within a fraction of a second. A worker that hangs is not
this module's to judge: the step watchdog of the process running the step ends it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from otel_engine.config import EngineConfig
from otel_engine.errors import FailureCause
from otel_engine.executor.hang import ask_ranks
from otel_engine.executor.rank_plans import collect
from otel_engine.executor.responder import flight_recorder_env
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import (
    ErrorInfo,
    ModelInput,
    ModelOutput,
    RankReport,
    StopWorker,
    WorkerFailure,
    WorkerRequest,
    WorkerResponse,
)
from otel_engine.ipc.paths import IpcDir, loopback_env
from otel_engine.ipc.process import (
    ENGINE_CORE,
    ChildProcess,
    process_title,
    spawn,
    stop_all,
    wait_for_death,
)
from otel_engine.model.bandwidth import MemoryBandwidth
from otel_engine.model.limits import EngineLimits
from otel_engine.observability.faults import maybe_inject
from otel_engine.observability.setup import spawn_env
from otel_engine.timing import (
    FAILED_REPORT_WAIT_S,
    FAILURE_GRACE_S,
    GRACEFUL_WORKER_STOP_MAX_S,
    MONITOR_JOIN_S,
    STOP_SEND_TIMEOUT_S,
    WORKER_RESULT_POLL_S,
)

logger = logging.getLogger(__name__)


class WorkerError(Exception):
    """A worker failed or died; carries the flattened cause."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.process}: {info.type}: {info.message}")
        self.info = info


def failure_info(exc: BaseException, process: str) -> ErrorInfo:
    """What failed, for `EngineDead`: a worker's own error as it reported it, else `exc`."""
    if isinstance(exc, WorkerError):
        return exc.info
    return error_info(exc, process)


def choose_root_cause(
    died: ErrorInfo | None, failures: Sequence[WorkerFailure], first_seen: ErrorInfo
) -> ErrorInfo:
    """Which failure caused the others. A worker that died without a report (killed, OOM)
    is the cause: its peers' collectives broke because of it. Else the earliest report (a
    worker that raised reports before it exits). Else the failure seen first."""
    reporters = {process_title("worker", f.rank) for f in failures}
    if died is not None and died.process not in reporters:
        return died
    if failures:
        return min(failures, key=lambda f: f.failed_at).error
    return first_seen


def expects_report(
    died: ErrorInfo | None, exit_code: int | None, failures: Sequence[WorkerFailure], waited: float
) -> bool:
    """Whether to wait longer for a report: a worker that raised reports, then exits with
    code 1, and its report can arrive after its death is seen (for `FAILED_REPORT_WAIT_S`)."""
    reporters = {process_title("worker", f.rank) for f in failures}
    silent = died is not None and died.process not in reporters
    return silent and exit_code == 1 and waited < FAILED_REPORT_WAIT_S


def worker_death(workers: list[ChildProcess]) -> tuple[ErrorInfo, int | None]:
    """Block until one of `workers` exits: `WorkerDied` naming it and how (for a native
    fault: the signal and where), and its exit code."""
    worker = wait_for_death(workers)
    # Peers of a worker that died of a signal exit 1 a moment later (their collective
    # broke); when both deaths are seen at once, the one that did not exit 1 is the cause.
    worker = next((w for w in workers if w.exitcode not in (None, 1)), worker)
    info = worker.death_error(FailureCause.WORKER_DIED, worker.name, worker.name)
    return info, worker.exitcode


class UniprocExecutor:
    """The model runs right here (TP=1)."""

    def __init__(self, config: EngineConfig, model_dir: str, limits: EngineLimits) -> None:
        from otel_engine.executor.model_runner import ModelRunner  # torch: only where it runs

        maybe_inject("worker", phase="load", rank=0)
        self.runner = ModelRunner(config, model_dir, limits, rank=0)
        self.fast_paths: dict[str, Any] | None = collect([self.runner.model.fast_paths.summary()])
        self.memory_bandwidth = self.runner.memory_bandwidth  # model/bandwidth.py

    def execute(self, step: ModelInput) -> ModelOutput:
        maybe_inject(
            "worker",
            phase="run",
            rank=0,
            step=step.step_id,
            num_requests=len(step.query_lens),
            num_tokens=len(step.input_ids),
            prompt_len=step.max_prompt_len,
        )
        return self.runner.execute(step)

    def check_health(self, next_step: int | None = None) -> None:
        """Nothing to watch: a failure raises in `execute` itself."""

    def ask_ranks(self) -> list[RankReport | None]:
        """No workers to ask: the hang is in this process."""
        return []

    def kill(self) -> None:
        """No child processes to kill."""

    def shutdown(self, *, graceful: bool = True) -> None:
        """Nothing to stop: the model lives in this process."""

    def process_pids(self) -> dict[str, int | None]:
        return {ENGINE_CORE: os.getpid()}

    def placement(self) -> list[dict[str, Any]]:
        """Every rank is on this machine: nothing to say (a Ray cluster's ranks say where)."""
        return []


class MultiprocExecutor:
    """`tensor_parallel_size` worker processes, rank 0 samples."""

    config: EngineConfig
    tp_size: int
    _requests: Codec[WorkerRequest]
    _responses: Codec[WorkerResponse]
    _context: zmq.Context[zmq.Socket[bytes]]
    _inputs: list[zmq.Socket[bytes]]
    _results: zmq.Socket[bytes]
    _probe_addresses: list[str]
    workers: list[ChildProcess]
    fast_paths: dict[str, Any] | None
    memory_bandwidth: MemoryBandwidth | None
    _failure: ErrorInfo | None
    _died: ErrorInfo | None
    _died_code: int | None
    _root: ErrorInfo | None
    _stopping: bool
    _monitor: threading.Thread | None

    def __init__(
        self, config: EngineConfig, model_dir: str, limits: EngineLimits, ipc_dir: IpcDir
    ) -> None:
        self._init_state(config)
        self._results.bind(ipc_dir.address("worker-out"))
        self._probe_addresses = [ipc_dir.address(f"worker-probe-{r}") for r in range(self.tp_size)]
        store_path = ipc_dir.file("dist-store-port")  # rank 0 publishes its store's port
        for rank in range(self.tp_size):
            socket = self._context.socket(zmq.PUSH)
            address = ipc_dir.address(f"worker-in-{rank}")
            socket.bind(address)
            self._inputs.append(socket)
        worker_env = {**spawn_env(config), **flight_recorder_env(), **loopback_env()}
        try:
            for rank in range(self.tp_size):
                self.workers.append(
                    spawn(
                        "otel_engine.executor.worker:run_worker",
                        config.encode(),
                        model_dir,
                        limits.encode(),
                        rank,
                        store_path,
                        ipc_dir.address(f"worker-in-{rank}"),
                        ipc_dir.address("worker-out"),
                        self._probe_addresses[rank],
                        role="worker",
                        rank=rank,
                        env=worker_env,
                        fault_dir=ipc_dir.path,
                    )
                )
            deadline = time.monotonic() + config.timeouts.engine_ready_timeout
            ready = [worker.wait_ready(deadline) for worker in self.workers]
            self.fast_paths = collect([r.fast_paths or {} for r in ready])
            self.memory_bandwidth = ready[0].memory_bandwidth  # rank 0's (model/bandwidth.py)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        self._monitor = threading.Thread(
            target=self._watch_workers, name="worker-monitor", daemon=True
        )
        self._monitor.start()

    def _init_state(self, config: EngineConfig) -> None:
        """What the step path needs, before any rank exists (the Ray executor's too)."""
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self._requests = Codec(WorkerRequest)
        self._responses = Codec(WorkerResponse)
        self._context = zmq.Context(io_threads=1)
        self._inputs = []
        self.workers = []  # local processes (none on Ray)
        self._failure = None
        self.fast_paths = None  # every rank's plan (`rank_plans`), once they are ready
        self.memory_bandwidth = None
        self._died = None  # a worker that exited, as the monitor saw it
        self._died_code = None
        self._root = None  # the cause, once decided
        self._stopping = False
        self._monitor = None
        self._results = self._context.socket(zmq.PULL)
        self._probe_addresses = []

    def _watch_workers(self) -> None:
        died, exit_code = worker_death(self.workers)
        if self._stopping:
            return
        logger.error(
            "worker.died",
            extra={
                "worker": died.process,
                "exitcode": exit_code,
                "signal": died.signal or None,
                "location": died.location or None,
            },
        )
        self._died_code, self._died = exit_code, died
        if self._failure is None:
            self._failure = died

    def check_health(self, next_step: int | None = None) -> None:
        """Raise WorkerError if a worker has died or reported a failure, or sent a result
        nobody asked for (before `next_step`, when one is about to run)."""
        if self._failure is None and self._results.poll(0):
            self._take_result(next_step)
        if self._failure is not None:
            self._failure = self._root_cause([])
            raise WorkerError(self._failure)

    def execute(self, step: ModelInput) -> ModelOutput:
        self.check_health(step.step_id)
        data = self._requests.encode(step)
        for socket in self._inputs:
            socket.send(data, copy=False)
        # No deadline here: a step that hangs is the step watchdog's to end, in the process
        # that runs the step (core_proc.StepWatchdog; the caller's, for in-process engines).
        while True:
            if self._results.poll(int(WORKER_RESULT_POLL_S * 1000)):
                return self._take_result(step.step_id)
            if self._failure is not None:  # the monitor saw a worker die
                self._failure = self._root_cause([])
                raise WorkerError(self._failure)

    def _take_result(self, step_id: int | None) -> ModelOutput:
        """The sampled tokens of `step_id` (None: no step is running). A failure report, or
        a result for another step (the core and its workers disagree on where they are: a
        protocol bug that would otherwise look like a hang), raises WorkerError."""
        message = self._responses.decode(self._results.recv(copy=False).buffer)
        if isinstance(message, WorkerFailure):
            self._failure = self._root_cause([message])
            raise WorkerError(self._failure)
        if message.step_id != step_id:
            waiting = "no step" if step_id is None else f"step {step_id}"
            sender = process_title("worker", 0)  # rank 0 sends the results
            self._failure = self._root = ErrorInfo(
                type=FailureCause.STEP_MISMATCH,
                message=f"{sender} sent the result of step {message.step_id} while the "
                f"engine core was waiting for {waiting}",
                process=sender,
                rank=0,
            )
            raise WorkerError(self._failure)
        return message

    def ask_ranks(self) -> list[RankReport | None]:
        """Every worker's answer to where it is (`hang.ask_ranks`), from any thread."""
        return ask_ranks(self._context, self._probe_addresses)

    def placement(self) -> list[dict[str, Any]]:
        """Every rank is on this machine: nothing to say (a Ray cluster's ranks say where)."""
        return []

    def process_pids(self) -> dict[str, int | None]:
        pids: dict[str, int | None] = {ENGINE_CORE: os.getpid()}
        pids.update((w.name, w.pid) for w in self.workers)
        return pids

    def kill(self) -> None:
        """SIGKILL every worker now (fatal paths where a graceful stop cannot work)."""
        self._stopping = True
        for worker in self.workers:
            worker.kill()

    def _root_cause(self, failures: list[WorkerFailure]) -> ErrorInfo:
        """Collect the failure reports that arrive within a moment (`FAILURE_GRACE_S`, longer
        while `expects_report`), then decide once (`choose_root_cause`)."""
        if self._root is not None:
            return self._root
        started = time.monotonic()
        while True:
            waited = time.monotonic() - started
            if waited > FAILURE_GRACE_S and not expects_report(
                self._died, self._died_code, failures, waited
            ):
                break
            if self._results.poll(int(1000 * WORKER_RESULT_POLL_S)):
                message = self._responses.decode(self._results.recv(copy=False).buffer)
                if isinstance(message, WorkerFailure):
                    failures.append(message)
        assert self._failure is not None
        self._root = choose_root_cause(self._died, failures, self._failure)
        return self._root

    def shutdown(self, *, graceful: bool = True) -> None:
        """Ask workers to stop, then escalate (SIGTERM, SIGKILL) under one deadline.

        `graceful=False` (fatal paths, failed startup) skips the polite phase: a worker
        stuck in a collective would never read `StopWorker`.
        """
        self._stopping = True
        graceful_s = 0.0
        if graceful and self._failure is None:
            graceful_s = min(self.config.timeouts.shutdown_timeout, GRACEFUL_WORKER_STOP_MAX_S)
            stop = self._requests.encode(StopWorker())
            for socket in self._inputs:
                socket.setsockopt(zmq.SNDTIMEO, int(1000 * STOP_SEND_TIMEOUT_S))
                try:
                    socket.send(stop)
                except zmq.ZMQError:
                    graceful_s = 0.0
        stop_all(self.workers, graceful_s=graceful_s)
        if self._monitor is not None:
            self._monitor.join(timeout=MONITOR_JOIN_S)
        for worker in self.workers:
            worker.close()
        for socket in [*self._inputs, self._results]:
            socket.close(linger=0)
        self._context.term()


Executor = UniprocExecutor | MultiprocExecutor


def make_executor(
    config: EngineConfig, model_dir: str, limits: EngineLimits, ipc_dir: IpcDir
) -> Executor:
    """The executor `config` asks for, its ranks started with `limits` (resolved once, by
    the caller) and ready."""
    if config.parallel.distributed_executor_backend == "ray":
        from otel_engine.executor.ray_executor import RayExecutor  # ray: only when asked for

        return RayExecutor(config, model_dir, limits)
    if config.parallel.tensor_parallel_size == 1:
        return UniprocExecutor(config, model_dir, limits)
    return MultiprocExecutor(config, model_dir, limits, ipc_dir)
