"""The engine core process (`otel-engine-core`): the step loop behind two ZMQ sockets.

Inputs (AddRequest, AbortRequests, PauseRequests, ResumeRequests, Shutdown) arrive on a PULL
socket; each step's `StepOutputs` leave on a PUSH socket, one frame per step, plus a frame
with no step when inputs changed the scheduler's state and no step follows. The step
watchdog's `Heartbeat`s come on a socket of their own. Any exception in
the loop, including a worker's failure surfaced by the executor, becomes one `EngineDead`
frame to the front end before the process shuts its workers down and exits 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import threading
import time

import zmq

from otel_engine.config import EngineConfig, SpeculativeMethod
from otel_engine.engine.core import EngineCore
from otel_engine.engine.grammars import GrammarCompiler
from otel_engine.executor.channel import failure_info
from otel_engine.executor.executor import make_executor
from otel_engine.ipc.codec import Codec
from otel_engine.ipc.messages import (
    AddRequest,
    CoreOutput,
    CoreRequest,
    EngineDead,
    Heartbeat,
    Shutdown,
)
from otel_engine.ipc.paths import IpcDir
from otel_engine.ipc.process import ENGINE_CORE, ReadyChannel, on_parent_death
from otel_engine.memory import freeze_startup_objects
from otel_engine.model.arch import load_model_arch
from otel_engine.model.limits import resolve_limits
from otel_engine.observability.faults import FaultPhase, maybe_inject
from otel_engine.observability.tracing import shutdown_telemetry
from otel_engine.timing import (
    CORE_IDLE_POLL_S,
    CRASH_FLUSH_S,
    GRAMMAR_POLL_S,
    HEARTBEAT_INTERVAL_S,
    LAST_FRAME_LINGER_S,
    TELEMETRY_FLUSH_S,
    THREAD_JOIN_S,
    watchdog_poll_s,
)

logger = logging.getLogger(__name__)

PROCESS_NAME = ENGINE_CORE
# What a spare engine core imports before it is launched (`ipc.process.Standby`): torch and
# the model code, the most of an engine core's start after the weights.
PRELOAD = ("otel_engine.engine.core_proc", "otel_engine.executor.model_runner")
# The exit of an engine core that failed after recording its crash dump and sending
# EngineDead; any other unasked-for exit left no dump (the front end records one).
FAILED_EXIT_CODE = 1


def build_engine_core(config: EngineConfig, model_dir: str, ipc_dir: IpcDir) -> EngineCore:
    """The model's limits (resolved here, once, for every rank), the executor (its workers
    started and ready) while the grammar thread builds its token trie, and the core."""
    arch = load_model_arch(model_dir)
    limits = resolve_limits(config, arch)
    grammars = GrammarCompiler(model_dir, arch.vocab_size, arch.eos_token_ids)
    grammars.start()
    try:
        maybe_inject(ENGINE_CORE, phase=FaultPhase.LOAD)
        executor = make_executor(config, model_dir, limits, ipc_dir)
    except BaseException:
        grammars.shutdown()
        raise
    try:
        speculator = None
        if config.speculative.speculative_method == SpeculativeMethod.DRAFT:
            # Here, not at import: a draft model runs in this process, which otherwise at
            # TP > 1 runs no model and never loads torch.
            from otel_engine.spec.draft import DraftSpeculator

            speculator = DraftSpeculator(config, arch, limits)
    except BaseException:
        grammars.shutdown()
        executor.shutdown(graceful=False)
        raise
    return EngineCore(config, arch, limits, executor, model_dir, grammars, speculator)


def run_engine_core(
    channel: ReadyChannel,
    config_bytes: bytes,
    model_dir: str,
    ipc_path: str,
    input_address: str,
    output_address: str,
) -> None:
    """Process target of `otel-engine-core`."""
    config = EngineConfig.decode(config_bytes)
    ipc_dir = IpcDir(config.instance_id, path=ipc_path)
    # The front end removes the directory when it stops; when it was killed, the engine
    # core is the last process of the server that knows it (its workers follow it out).
    on_parent_death(functools.partial(shutil.rmtree, ipc_dir.path, ignore_errors=True))
    core = build_engine_core(config, model_dir, ipc_dir)
    freeze_startup_objects()
    context = zmq.Context(io_threads=1)
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    watchdog = StepWatchdog(core, output_address)
    channel.ready(core.limits, core.fast_paths, core.memory_bandwidth)
    logger.info("engine.ready", extra={"role": ENGINE_CORE})
    exit_code = 0
    encoder: Codec[CoreOutput] = Codec(CoreOutput)
    try:
        _busy_loop(core, inputs, outputs, encoder)
    except Exception as exc:
        exit_code = FAILED_EXIT_CODE
        logger.exception("engine.failed")
        info = failure_info(exc, PROCESS_NAME)
        core.record_crash(info)
        shutdown_telemetry(timeout_s=CRASH_FLUSH_S)  # the dump reaches the collector first
        dead = EngineDead(
            error=info, trace_context=core.failed_step_context, batch=core.failed_batch()
        )
        outputs.send(encoder.encode(dead))
    finally:
        watchdog.stop()
        core.shutdown(graceful=exit_code == 0)
        inputs.close(linger=0)
        outputs.close(linger=int(1000 * LAST_FRAME_LINGER_S))
        context.term()
    logger.info("engine.stopped", extra={"exit_code": exit_code})
    shutdown_telemetry(timeout_s=min(TELEMETRY_FLUSH_S, config.timeouts.shutdown_timeout))
    if exit_code:
        os._exit(exit_code)


class StepWatchdog:
    """Thread `step-watchdog`: a step running past --step-timeout is fatal.

    It works whatever hangs (a worker's collective, the model at TP=1, the scheduler):
    the watchdog reports `EngineDead` on its own socket, kills the workers and exits,
    without waiting for the stuck main thread. Each time it looks it also sends a
    `Heartbeat`, so the front end tells a long step (heartbeats go on) from a frozen process
    (nothing comes).
    """

    def __init__(self, core: EngineCore, output_address: str) -> None:
        self.core = core
        self.timeout = core.config.timeouts.step_timeout
        self._stop = threading.Event()
        self._context = zmq.Context(io_threads=1)  # its own, so it can flush on exit
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.connect(output_address)
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        core = self.core
        heartbeat = Codec(CoreOutput).encode(Heartbeat())
        poll_s = min(watchdog_poll_s(core.config.timeouts), HEARTBEAT_INTERVAL_S)
        while not self._stop.wait(poll_s):
            # Never blocks: a front end that stopped reading must not stop the watchdog.
            with contextlib.suppress(zmq.Again):
                self._socket.send(heartbeat, flags=zmq.NOBLOCK)
            started = core.step_started_at
            if started is None or time.monotonic() - started < self.timeout:
                continue
            dead = core.give_up_on_step(PROCESS_NAME)
            self._socket.send(Codec(CoreOutput).encode(dead))
            self._socket.close(linger=int(1000 * LAST_FRAME_LINGER_S))
            self._context.term()  # waits until the frame is delivered
            os._exit(FAILED_EXIT_CODE)
        self._socket.close(linger=0)
        self._context.term()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=THREAD_JOIN_S)


def _busy_loop(
    core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, encoder: Codec[CoreOutput]
) -> None:
    decoder: Codec[CoreRequest] = Codec(CoreRequest)
    executor = core.executor
    while True:
        if not core.has_work:
            while not core.has_compiled() and not inputs.poll(_idle_poll_ms(core)):
                executor.check_health()
        refused = core.admit_compiled()
        is_changed = False
        while inputs.poll(0):
            message = decoder.decode(inputs.recv(copy=False).buffer)
            if isinstance(message, Shutdown):
                return
            update = core.handle(message)
            if update is not None:
                refused.append(update)
            is_changed = is_changed or not isinstance(message, AddRequest)
        if refused or (is_changed and not core.has_work):
            # no step follows to carry the new state (e.g. the last request was aborted)
            outputs.send(encoder.encode(core.state_outputs(refused)))
        if core.has_work:
            outputs.send(encoder.encode(core.step()))


def _idle_poll_ms(core: EngineCore) -> int:
    """How long an idle core waits for input: briefly while a grammar is being built (its
    request starts when it is ready)."""
    return int((GRAMMAR_POLL_S if core.is_compiling else CORE_IDLE_POLL_S) * 1000)
