"""How the front end talks to the engine core: directly, or to its process over ZMQ.

`InprocClient` holds an `EngineCore` and steps it in the caller's thread (with faulthandler
on stderr, so that a native fault leaves its stack there). `MPClient` spawns
`otel-engine-core`, waits for its handshake, and watches its process sentinel: a core that
dies without a word (a native fault, SIGKILL, the OOM killer) becomes an `EngineDead`
output within a poll interval, and, since that core recorded no crash dump, this side
records one (`record_core_death`). It also times the core's silence (`silent_for`): a core
process that sends nothing, not even its step watchdog's heartbeat, is frozen. Chosen once,
at construction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from opentelemetry import trace

from otel_engine.config import EngineConfig
from otel_engine.engine.core import EngineCore
from otel_engine.engine.core_proc import (
    FAILED_EXIT_CODE,
    PRELOAD,
    PROCESS_NAME,
    build_engine_core,
)
from otel_engine.errors import EngineDeadError, EngineStartupError, FailureCause
from otel_engine.executor.channel import failure_info
from otel_engine.ipc.codec import Codec
from otel_engine.ipc.messages import (
    AbortRequests,
    AddRequest,
    CoreOutput,
    CoreRequest,
    EngineDead,
    ErrorInfo,
    Heartbeat,
    PauseRequests,
    ResumeRequests,
    Shutdown,
    StepOutputs,
)
from otel_engine.ipc.native_fault import enable_on_stderr
from otel_engine.ipc.paths import IpcDir
from otel_engine.ipc.process import ENGINE_CORE, Standby, wait_for_death
from otel_engine.model.limits import EngineLimits
from otel_engine.observability import crash_delivery, crash_dump
from otel_engine.observability.decode_bandwidth import DecodeBandwidth
from otel_engine.observability.faults import RESTARTS_ENV_VAR
from otel_engine.observability.setup import spawn_env
from otel_engine.observability.tracing import get_tracer, inject_context, is_tracing
from otel_engine.sched.scheduler import SchedulerOutput
from otel_engine.timing import (
    CORE_OUTPUT_POLL_S,
    CORE_SEND_RETRY_S,
    MONITOR_JOIN_S,
    THREAD_JOIN_S,
    front_end_ready_s,
)

logger = logging.getLogger(__name__)


class _StepThread:
    """Thread `engine-step`: builds and steps the in-process engine core, so that the caller
    can stop waiting for a step that hangs (a daemon: a hung step never blocks the exit).
    All of the engine's compute runs on this one thread: torch's OpenMP threads belong to
    the thread that calls it, and two threads taking turns made every step 1.6x slower."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                self._results.put((True, call()))
            except BaseException as exc:
                self._results.put((False, exc))

    def call(self, function: Callable[[], Any], timeout: float) -> Any:
        """`function()`'s result or exception; TimeoutError if it did not finish in time."""
        self._calls.put(function)
        try:
            is_ok, value = self._results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None
        if not is_ok:
            raise value
        return value

    def stop(self, *, wait: bool) -> None:
        """End the thread; with `wait`, join it, so that it has let go of torch's per-thread
        state before the interpreter exits (a thread still tearing down while the process's
        static destructors run aborts it: "terminate called without an active exception")."""
        self._calls.put(None)
        if wait:
            self._thread.join(timeout=THREAD_JOIN_S)


class InprocClient:
    """The engine core in this process; `get_output()` runs one step (on the `engine-step`
    thread, watched by the caller for `--step-timeout` like the core process's watchdog)."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        enable_on_stderr()
        self.ipc_dir = IpcDir(config.instance_id)
        self._steps = _StepThread()
        try:
            self.core: EngineCore = self._steps.call(
                lambda: build_engine_core(config, model_dir, self.ipc_dir),
                front_end_ready_s(config.timeouts),
            )
        except EngineStartupError:
            self._steps.stop(wait=True)
            self.ipc_dir.cleanup()
            raise
        except Exception as exc:
            self._steps.stop(wait=True)
            self.ipc_dir.cleanup()
            raise EngineStartupError(
                f"engine_core failed to start: {type(exc).__name__}: {exc}",
                failed_process=ENGINE_CORE,
                traceback="".join(traceback.format_exception(exc)),
                cause_type=type(exc).__name__,
                cause_message=str(exc),
            ) from exc
        self.limits = self.core.limits
        self.max_model_len = self.limits.max_model_len
        self.fast_paths = self.core.fast_paths
        self.memory_bandwidth = self.core.memory_bandwidth
        self._pending: list[StepOutputs] = []
        self._death: EngineDead | None = None
        self._hung = False  # a step outlived --step-timeout: its thread is left behind

    def add_request(self, message: AddRequest) -> None:
        rejected = self.core.add_request(message)
        if rejected is not None:
            self._pending.append(self.core.state_outputs([rejected]))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.handle(AbortRequests(request_ids))

    def pause_requests(self, request_ids: list[str]) -> None:
        self.core.handle(PauseRequests(request_ids))

    def resume_requests(self, request_ids: list[str]) -> None:
        self.core.handle(ResumeRequests(request_ids))

    def get_output(self) -> CoreOutput | None:
        """Run one step; a failure in it becomes `EngineDead`, as in the process shell."""
        if self._death is not None:
            return self._death
        core = self.core
        refused = core.admit_compiled()
        if refused:
            self._pending.append(core.state_outputs(refused))
        if self._pending:
            return self._pending.pop()
        if not core.has_work:
            core.wait_compiled(CORE_OUTPUT_POLL_S)  # a structured request's grammar
            return None
        return self._step(core.step)

    def run_batch(self, output: SchedulerOutput) -> CoreOutput:
        """Run one batch scheduled by the caller (`otel-engine replay`), as `get_output` runs
        a step: its outputs, or `EngineDead` when it fails or hangs."""
        core = self.core
        return self._step(lambda: core.run(output))

    def _step(self, step: Callable[[], StepOutputs]) -> CoreOutput:
        core = self.core
        timeout = core.config.timeouts.step_timeout
        try:
            output: StepOutputs = self._steps.call(step, timeout)
            return output
        except TimeoutError:
            self._hung = True
            self._death = core.give_up_on_step(ENGINE_CORE)
            return self._death
        except Exception as exc:
            logger.exception("engine.failed")
            self._death = EngineDead(
                error=failure_info(exc, ENGINE_CORE),
                trace_context=core.failed_step_context,
                batch=core.failed_batch(),
            )
            return self._death

    def shutdown(self) -> None:
        self._steps.stop(wait=not self._hung)
        self.core.shutdown(graceful=self._death is None)
        self.ipc_dir.cleanup()


def spare_core(config: EngineConfig) -> Standby:
    """An engine core process started ahead of a restart, torch and the model code imported
    (`core_proc.PRELOAD`), for `MPClient`'s `standby`: a restart then skips those seconds."""
    return Standby(spawn_env(config), preload=PRELOAD)


class MPClient:
    """The engine core in its own process, behind two ZMQ sockets that this side binds."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        restarts: int = 0,
        standby: Standby | None = None,
    ) -> None:
        """`restarts`: how many engines this server started before this one (`recovery`);
        `standby`: a `spare_core` to launch it in (else a new process)."""
        self.config = config
        self.restarts = restarts
        self.ipc_dir = IpcDir(config.instance_id)
        self._encoder: Codec[CoreRequest] = Codec(CoreRequest)
        self._decoder: Codec[CoreOutput] = Codec(CoreOutput)
        self._context = zmq.Context(io_threads=1)
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.bind(self.ipc_dir.address("core-in"))
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(self.ipc_dir.address("core-out"))
        self._death: ErrorInfo | None = None
        self._crash_context: dict[str, str] = {}  # the crash span of a dump recorded here
        self._kill_reason: ErrorInfo | None = None  # why this side gave the core up
        self._started_at = time.monotonic()
        self._stopping = False
        self._is_retired = False  # a failed engine being replaced: nothing more is sent
        self._monitor: threading.Thread | None = None
        standby = standby or Standby(spawn_env(config))
        self.core = standby.launch(
            "otel_engine.engine.core_proc:run_engine_core",
            config.encode(),
            model_dir,
            self.ipc_dir.path,
            self.ipc_dir.address("core-in"),
            self.ipc_dir.address("core-out"),
            role=ENGINE_CORE,
            env={RESTARTS_ENV_VAR: str(restarts)},
            fault_dir=self.ipc_dir.path,
        )
        try:
            ready = self.core.wait_ready(time.monotonic() + front_end_ready_s(config.timeouts))
        except BaseException:
            self.shutdown(graceful=False)  # a core still starting never reads Shutdown
            raise
        assert ready.limits is not None, "the engine core's Ready carries its limits"
        self.limits = ready.limits
        self.max_model_len = ready.limits.max_model_len
        self.fast_paths = ready.fast_paths  # every rank's plan (`executor/rank_plans.py`)
        self.memory_bandwidth = ready.memory_bandwidth  # rank 0's peak (model/bandwidth.py)
        self.bandwidth = DecodeBandwidth(self.memory_bandwidth)  # for a dump made here
        self._heard_at = time.monotonic()
        self._monitor = threading.Thread(target=self._watch_core, name="core-monitor", daemon=True)
        self._monitor.start()

    def _watch_core(self) -> None:
        wait_for_death([self.core])
        if self._stopping:
            return
        info = self._kill_reason or self.core.death_error(
            FailureCause.ENGINE_CORE_DIED, "the engine core", PROCESS_NAME
        )
        code = self.core.exitcode
        logger.error(
            "engine_core.died",
            extra={
                "exitcode": code,
                "signal": info.signal or None,
                "location": info.location or None,
            },
        )
        if code != FAILED_EXIT_CODE:  # it died before recording its own crash dump
            self._crash_context = record_core_death(
                self.config,
                self.limits,
                info,
                self._started_at,
                self.fast_paths,
                self.bandwidth.part(),
                self.restarts,
            )
        self._death = info

    def retire(self) -> None:
        """Send nothing more to this engine (it failed and is being replaced); its sockets
        stay open until `shutdown`, from whichever thread."""
        self._is_retired = True

    def add_request(self, message: AddRequest) -> None:
        if self._death is not None or self._stopping or self._is_retired or not self._push(message):
            raise EngineDeadError(
                "the engine is not running",
                cause_type=self._death.type if self._death else FailureCause.ENGINE_SHUTDOWN,
            )

    def _push(self, message: CoreRequest) -> bool:
        """Send `message` to the core; False when the core is gone. A PUSH socket whose
        peer died blocks a plain send forever (the core-monitor thread may not have seen the
        death yet), so the send never blocks and waits for room only while the core lives."""
        data = self._encoder.encode(message)
        while True:
            try:
                self._inputs.send(data, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                if self._death is not None or not self.core.is_alive():
                    return False
                self._inputs.poll(int(CORE_SEND_RETRY_S * 1000), zmq.POLLOUT)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def pause_requests(self, request_ids: list[str]) -> None:
        self._send(PauseRequests(request_ids))

    def resume_requests(self, request_ids: list[str]) -> None:
        self._send(ResumeRequests(request_ids))

    def _send(self, message: CoreRequest) -> None:
        if self._death is None and not self._stopping and not self._is_retired:
            self._push(message)  # a core that is gone has nothing to abort, pause or resume

    def get_output(self, timeout_s: float = CORE_OUTPUT_POLL_S) -> StepOutputs | EngineDead | None:
        """The next output, an `EngineDead` if the core process is gone, or None on timeout
        (or when the frame was the core's heartbeat).

        A frame already sent wins over the death notice, so the engine's own reason
        (e.g. a worker's exception) is reported rather than just "the core exited".
        """
        if self._outputs.poll(int(timeout_s * 1000)):
            output = self._decoder.decode(self._outputs.recv(copy=False).buffer)
            self._heard_at = time.monotonic()
            if isinstance(output, StepOutputs):
                self.bandwidth.observe(output.decode_bandwidth, output.step_duration_s)
            return None if isinstance(output, Heartbeat) else output
        if self._death is not None:
            return EngineDead(error=self._death, trace_context=self._crash_context)
        return None

    @property
    def silent_for(self) -> float:
        """Seconds since the last frame from the core (its heartbeat comes every
        `HEARTBEAT_INTERVAL_S`, also during a step), as the reader of `get_output` saw it."""
        return time.monotonic() - self._heard_at

    @property
    def is_alive(self) -> bool:
        return self._death is None

    def kill(self, reason: ErrorInfo | None = None) -> None:
        """SIGKILL the engine core (its workers follow through their death pipes); `reason`
        (why it was given up) is the failure its crash dump records instead of the kill."""
        self._kill_reason = reason
        self.core.kill()

    def shutdown(self, *, graceful: bool = True) -> None:
        """Ask the core to stop, then escalate; sockets closed, IPC directory removed.

        Not graceful (startup failed or was interrupted): SIGTERM at once; the core's
        workers follow through their death pipes.
        """
        if self._stopping:
            return
        self._stopping = True
        graceful_s = (
            self.config.timeouts.shutdown_timeout if graceful and self._death is None else 0.0
        )
        if graceful_s:
            try:
                self._inputs.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                graceful_s = 0.0
        self.core.stop(timeout=graceful_s)
        if self._monitor is not None:
            self._monitor.join(timeout=MONITOR_JOIN_S)
        self.core.close()
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self.ipc_dir.cleanup()


def record_core_death(
    config: EngineConfig,
    limits: EngineLimits,
    info: ErrorInfo,
    started_at: float,
    fast_paths: dict[str, Any] | None = None,
    memory_bandwidth: dict[str, Any] | None = None,
    engine_restarts: int = 0,
) -> dict[str, str]:
    """The crash dump of an engine core that died without recording one, built here from
    what the front end knows (the failure, the engine config; the batch, the history and
    the scheduler marked `not_available`) and delivered like the core's own: a stand-alone
    `engine_core.crash` span, the `engine_crash_dump` log line, the --crash-dump-dir file.
    Returns the span's context for the `EngineDead` the clients get. Never raises."""
    try:
        failure = crash_delivery.failure_of(info)
        lost = "the engine core died before it could record it"
        dump = crash_dump.build_dump(
            {
                "scheduler_output": lambda: crash_dump.not_available(lost),
                "engine_config": lambda: crash_dump.engine_config_part(
                    config, limits=limits, fast_paths=fast_paths
                ),
                "history": lambda: crash_dump.not_available(lost),
                "system_stats": lambda: crash_dump.front_end_stats_part(
                    failure=failure,
                    started_at=started_at,
                    memory_bandwidth=memory_bandwidth,
                    engine_restarts=engine_restarts,
                ),
            }
        )
        span = get_tracer().start_span("engine_core.crash") if is_tracing() else None
        crash_delivery.deliver(dump, span, failure, config, logger)
        if span is None:
            return {}
        context = inject_context(trace.set_span_in_context(span))
        span.end()
        return context
    except Exception:
        logger.exception("engine_crash_dump.failed")
        return {}


CoreClient = InprocClient | MPClient
