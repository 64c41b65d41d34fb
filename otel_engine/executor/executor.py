"""Executors: run one step's `ModelInput` and return rank 0's sampled tokens.

`Executor` is what the engine core asks of one: run a step, say whether a rank has failed,
ask the ranks where they are (a hung step), kill and shut down its ranks, and name their
processes and places for a crash dump. `UniprocExecutor` runs the model in the calling
process (TP=1). `MultiprocExecutor` drives `--tensor-parallel-size` worker processes on this
machine and `RayExecutor` (ray_executor.py) ranks as Ray actors; both own a `StepChannel`
(channel.py) for the step path and its failures, and differ only in how they start ranks and
see one die: here a worker's process sentinel (killed, OOM) turns the current or next
`execute()` into `WorkerError` within a fraction of a second. A worker that hangs is not
this module's to judge: the step watchdog of the process running the step ends it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol

from otel_engine.config import EngineConfig, ExecutorBackend
from otel_engine.errors import FailureCause
from otel_engine.executor.channel import StepChannel
from otel_engine.executor.hang import ask_ranks
from otel_engine.executor.rank_plans import collect
from otel_engine.executor.responder import flight_recorder_env
from otel_engine.ipc.messages import ErrorInfo, ModelInput, ModelOutput, RankReport
from otel_engine.ipc.paths import IpcDir, loopback_env
from otel_engine.ipc.process import ENGINE_CORE, ChildProcess, spawn, stop_all, wait_for_death
from otel_engine.ipc.roles import ProcessRole
from otel_engine.model.bandwidth import MemoryBandwidth
from otel_engine.model.limits import EngineLimits
from otel_engine.observability.faults import FaultPhase, maybe_inject
from otel_engine.observability.setup import spawn_env
from otel_engine.timing import GRACEFUL_WORKER_STOP_MAX_S, MONITOR_JOIN_S

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """What the engine core asks of the ranks that run its steps."""

    fast_paths: dict[str, Any] | None  # every rank's plan (`rank_plans`), once they are ready
    memory_bandwidth: MemoryBandwidth | None  # rank 0's peak (model/bandwidth.py)

    def execute(self, step: ModelInput) -> ModelOutput:
        """Run `step` on every rank; rank 0's sampled tokens. A rank's failure raises."""

    def check_health(self, next_step: int | None = None) -> None:
        """Raise if a rank has failed since the last step (between steps)."""

    def ask_ranks(self) -> list[RankReport | None]:
        """Every rank's answer to where it is (None: no answer), from any thread."""

    def kill(self) -> None:
        """Kill every rank now (fatal paths)."""

    def shutdown(self, *, graceful: bool = True) -> None:
        """Stop every rank and give back what the executor holds."""

    def process_pids(self) -> dict[str, int | None]:
        """The processes on this machine, by title (for the crash dump)."""

    def placement(self) -> list[dict[str, Any]]:
        """Where each rank runs, where that is not this machine (for the crash dump)."""


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

        maybe_inject(ProcessRole.WORKER, phase=FaultPhase.LOAD, rank=0)
        self.runner = ModelRunner(config, model_dir, limits, rank=0)
        self.fast_paths: dict[str, Any] | None = collect([self.runner.model.fast_paths.summary()])
        self.memory_bandwidth = self.runner.memory_bandwidth  # model/bandwidth.py

    def execute(self, step: ModelInput) -> ModelOutput:
        maybe_inject(
            ProcessRole.WORKER,
            phase=FaultPhase.RUN,
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
    """`tensor_parallel_size` worker processes on this machine, rank 0 samples; the step
    path is its `StepChannel`'s, a worker's death is seen by its process sentinel."""

    def __init__(
        self, config: EngineConfig, model_dir: str, limits: EngineLimits, ipc_dir: IpcDir
    ) -> None:
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self.workers: list[ChildProcess] = []
        self.fast_paths: dict[str, Any] | None = None  # every rank's plan, once ready
        self.memory_bandwidth: MemoryBandwidth | None = None
        self._stopping = False
        self._monitor: threading.Thread | None = None
        self._probes = [ipc_dir.address(f"worker-probe-{r}") for r in range(self.tp_size)]
        self.channel = StepChannel(
            self.tp_size,
            ipc_dir.address("worker-out"),
            [ipc_dir.address(f"worker-in-{rank}") for rank in range(self.tp_size)],
        )
        store_path = ipc_dir.file("dist-store-port")  # rank 0 publishes its store's port
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
                        self.channel.input_addresses[rank],
                        self.channel.results_address,
                        self._probes[rank],
                        role=ProcessRole.WORKER,
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
        self.channel.rank_died(died, exit_code)

    def execute(self, step: ModelInput) -> ModelOutput:
        return self.channel.execute(step)

    def check_health(self, next_step: int | None = None) -> None:
        self.channel.check_health(next_step)

    def ask_ranks(self) -> list[RankReport | None]:
        """Every worker's answer to where it is (`hang.ask_ranks`), from any thread."""
        return ask_ranks(self.channel.context, self._probes)

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

    def shutdown(self, *, graceful: bool = True) -> None:
        """Ask workers to stop, then escalate (SIGTERM, SIGKILL) under one deadline.

        `graceful=False` (fatal paths, failed startup) skips the polite phase: a worker
        stuck in a collective would never read `StopWorker`.
        """
        self._stopping = True
        graceful_s = 0.0
        if graceful and not self.channel.failed and self.channel.send_stop():
            graceful_s = min(self.config.timeouts.shutdown_timeout, GRACEFUL_WORKER_STOP_MAX_S)
        stop_all(self.workers, graceful_s=graceful_s)
        if self._monitor is not None:
            self._monitor.join(timeout=MONITOR_JOIN_S)
        for worker in self.workers:
            worker.close()
        self.channel.close()


def make_executor(
    config: EngineConfig, model_dir: str, limits: EngineLimits, ipc_dir: IpcDir
) -> Executor:
    """The executor `config` asks for, its ranks started with `limits` (resolved once, by
    the caller) and ready."""
    if config.parallel.distributed_executor_backend == ExecutorBackend.RAY:
        from otel_engine.executor.ray_executor import RayExecutor  # ray: only when asked for

        return RayExecutor(config, model_dir, limits)
    if config.parallel.tensor_parallel_size == 1:
        return UniprocExecutor(config, model_dir, limits)
    return MultiprocExecutor(config, model_dir, limits, ipc_dir)
