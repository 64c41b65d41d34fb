"""`AsyncLLM`: streaming generation for servers, driven from any thread's event loop.

The engine core runs in its own process. A thread (`core-output-io`) receives its outputs
and hands them to the event loop that submitted the requests; an `EngineDead` frame, or the
core's process dying, fails every in-flight request with `EngineDeadError`, or, with
`--on-engine-failure restart` and within its budget, starts a new engine core (thread
`engine-restart`) and carries every in-flight request over to it (engine/recovery.py): its
consumer waits and then gets what it would have got without the failure. Nothing here
depends on signal handlers, so it works the same outside the main thread (faulthandler,
enabled on stderr as by `LLM`, is set up from any thread too).

Backpressure: a request is paused in the engine, giving its slot and KV blocks to others,
while its consumer holds it (`hold`: the HTTP server's stream saw its client stop reading)
or has not taken `MAX_UNDELIVERED_OUTPUTS` outputs, and resumed once neither is the case.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from otel_engine.config import EngineConfig
from otel_engine.engine.core_client import MPClient
from otel_engine.engine.frontend import Frontend, dead_error
from otel_engine.engine.output import RequestState
from otel_engine.engine.recovery import (
    DEFAULT_RESTART_S,
    RECOVERY_WAIT_QUEUE,
    RecoveryListener,
    RecoveryPolicy,
)
from otel_engine.errors import (
    EngineDeadError,
    EngineRecoveringError,
    ErrorCode,
    FailureCause,
    RequestFailedError,
)
from otel_engine.ipc.messages import AddRequest, EngineDead, ErrorInfo, StepOutputs
from otel_engine.ipc.native_fault import enable_on_stderr
from otel_engine.ipc.process import ENGINE_CORE
from otel_engine.observability.tracing import inject_context, link_from
from otel_engine.outputs import RequestOutput
from otel_engine.sampling_params import SamplingParams
from otel_engine.timing import HEARTBEAT_TIMEOUT_S, STALL_GRACE_S, THREAD_JOIN_S

logger = logging.getLogger(__name__)

MAX_UNDELIVERED_OUTPUTS = 32  # outputs waiting for their consumer before the request pauses
RESUME_BELOW_OUTPUTS = 8  # the consumer caught up: the request runs again
# The event loop hands out engine steps for at most this long before it answers sockets
# again: on a starved machine steps pile up, and handing out the whole backlog in one go
# kept `/health` waiting for hundreds of milliseconds.
DELIVER_BUDGET_S = 0.01
# The span event of a request carried over to a restarted engine (linked to the crash).
EVENT_ENGINE_RESTARTED = "otel_engine.request.engine_restarted"


@dataclass(slots=True, eq=False)
class _Stream:
    """One request's undelivered outputs (or the error that ends it) and its pause state."""

    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    is_paused: bool = False
    is_held: bool = False  # paused by its consumer (`AsyncLLM.hold`)
    span: trace.Span | None = None  # the request's span, for a restart's event and link
    crashed_at: float | None = None  # carried over: when its engine failed, until a token

    @property
    def may_resume(self) -> bool:
        return not self.is_held and self.queue.qsize() < RESUME_BELOW_OUTPUTS


class AsyncLLM:
    """Asynchronous engine: `async for output in llm.generate(prompt, params, request_id)`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        options.setdefault("multiprocess", True)
        self._setup(EngineConfig.from_kwargs(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup(config)
        return self

    def _setup(self, config: EngineConfig) -> None:
        if not config.parallel.multiprocess:
            raise ValueError("AsyncLLM runs the engine core in its own process (multiprocess=True)")
        enable_on_stderr()  # a native fault in this process leaves its stack on stderr
        self.config = config
        self._frontend = Frontend(config)
        self.tokenizer = self._frontend.tokenizer
        self.model_name = self._frontend.model_name
        self.max_model_len = self._frontend.max_model_len
        self.context_limited_by = self._frontend.context_limited_by  # what sets max_model_len
        self.fast_paths = self._frontend.fast_paths  # each rank's plan (executor/rank_plans.py)
        self.memory_bandwidth = self._frontend.memory_bandwidth  # model/bandwidth.py
        self.num_kv_blocks = self._frontend.num_kv_blocks  # the KV cache's size, in blocks
        self.generation_defaults = self._frontend.generation_defaults
        self.dead_error: EngineDeadError | None = None
        self.restarts = 0  # engines started after a failure (`--on-engine-failure restart`)
        self.is_recovering = False
        self._recovery = RecoveryPolicy(config.recovery)
        self._isolation = self._recovery.isolation
        self._crash: EngineDead | None = None  # the failure being recovered from
        self._crashed_at = 0.0
        self._restart_s = DEFAULT_RESTART_S  # how long the last restart took (Retry-After)
        self._waiting: list[asyncio.Future[None]] = []  # new requests waiting for a restart
        self._recovery_listeners: list[RecoveryListener] = []
        # Requests admitted to the current engine that have not produced a token since
        # (engine/recovery.py: a poison fails at its first step), and the requests of the
        # last step heard of: the account of the batch of a core that died without a word.
        self._not_started: set[str] = set()
        self._last_batch: set[str] = set()
        self._streams: dict[str, _Stream] = {}
        self.num_paused = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = threading.Event()
        self.last_progress_at = time.monotonic()
        self._step_listeners: list[Callable[[StepOutputs], None]] = []
        self._undelivered: deque[StepOutputs | EngineDead] = deque()
        self._drain_scheduled = False
        client = self._frontend.client
        assert isinstance(client, MPClient)
        self._client = client
        self._threads: list[threading.Thread] = []  # the output thread of the current engine
        self._start_output_thread(client)
        self._finalizer = weakref.finalize(
            self, _shutdown, self._stopped, self._frontend, self._threads
        )

    def _start_output_thread(self, client: MPClient) -> None:
        thread = threading.Thread(
            target=_pump_outputs,
            args=(weakref.ref(self), client, self._stopped),
            name="core-output-io",
            daemon=True,
        )
        thread.start()
        self._threads[:] = [thread]

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_tracked(self) -> int:
        """Requests with state in this front end (streams and output processing); 0 once
        every request ended, whatever way it ended."""
        return len(self._streams) + len(self._frontend.outputs.states)

    @property
    def is_stalled(self) -> bool:
        """Work is pending but no step finished within the step watchdog's window, or the
        engine core sent nothing, not even its heartbeat, for `HEARTBEAT_TIMEOUT_S` (the
        process is frozen, busy or idle; a long step goes on sending heartbeats)."""
        if self.is_recovering:
            return False
        return (
            self.stalled_for > self.config.timeouts.step_timeout
            or self.silent_for > HEARTBEAT_TIMEOUT_S
        )

    @property
    def silent_for(self) -> float:
        """Seconds since the engine core's last frame of any kind (0 once it is dead: then
        the engine is dead, not stalled)."""
        if self.dead_error is not None or self.is_recovering:
            return 0.0
        return self._client.silent_for

    @property
    def stalled_for(self) -> float:
        """Seconds without engine progress while requests are pending (0 when idle, or
        when every pending request is paused for its client)."""
        if len(self._streams) == self.num_paused or self.is_recovering:
            return 0.0
        return time.monotonic() - self.last_progress_at

    @property
    def retry_after_s(self) -> float:
        """How long a restart under way may still take (the last one's duration)."""
        return self._restart_s

    def add_recovery_listener(self, listener: RecoveryListener) -> None:
        """`listener` hears of every restart (metrics), in the event loop."""
        self._recovery_listeners.append(listener)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self._frontend.inputs.encode(prompt, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._frontend.inputs.decode(token_ids)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that produced tokens.

        Raises RequestError for an invalid request and EngineDeadError when the engine
        fails. Closing the iterator early aborts the request in the engine.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if self._stopped.is_set():
            raise EngineDeadError(
                "the engine is shut down", cause_type=FailureCause.ENGINE_SHUTDOWN
            )
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM is bound to the event loop of its first request")
        if self.is_recovering:
            await self._wait_for_restart()
        stream = _Stream(span=trace.get_current_span())
        self._frontend.add_request(request_id, prompt, params)
        self._not_started.add(request_id)
        if len(self._streams) == self.num_paused:
            self.last_progress_at = time.monotonic()
        self._streams[request_id] = stream
        queue = stream.queue
        finished = False
        try:
            while not finished:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if stream.is_paused and stream.may_resume:
                    self._set_paused(request_id, stream, False)
                yield item
        finally:
            self._forget(request_id)
            if not finished and self.dead_error is None and not self._stopped.is_set():
                self._frontend.abort([request_id])

    def hold(self, request_ids: list[str], held: bool) -> None:
        """Pause the requests in the engine until released (`held` False), whatever their
        consumers take meanwhile: their slots and KV blocks go to other requests, and they
        are recomputed from the prefix cache when they run again. For a stream whose client
        stopped reading; unknown or finished ids are ignored."""
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is None or stream.is_held == held:
                continue
            stream.is_held = held
            if held and not stream.is_paused:
                self._set_paused(request_id, stream, True)
            elif not held and stream.is_paused and stream.may_resume:
                self._set_paused(request_id, stream, False)

    async def abort(self, request_id: str) -> None:
        stream = self._forget(request_id)
        self._frontend.abort([request_id])
        if stream is not None:
            stream.queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    def _forget(self, request_id: str) -> _Stream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.is_paused:
            self.num_paused -= 1
        self._not_started.discard(request_id)
        self._isolation.forget(request_id)
        if self._isolation.num_suspects:  # it may have held the next trial back
            self._next_trial()
        return stream

    def _set_paused(self, request_id: str, stream: _Stream, is_paused: bool) -> None:
        stream.is_paused = is_paused
        if is_paused:
            self.num_paused += 1
            self._client.pause_requests([request_id])
            logger.info("request.paused", extra={"request_id": request_id})
            self._isolation.cleared(request_id)  # a trial its client stopped: it ends here
            if self._isolation.num_suspects:
                self._next_trial()
            return
        if len(self._streams) == self.num_paused:
            self.last_progress_at = time.monotonic()  # work pending again from now
        self.num_paused -= 1
        self._client.resume_requests([request_id])
        if self._isolation.is_suspect(request_id):  # its trial may start now
            self._next_trial()

    def _hand_over(self, output: StepOutputs | EngineDead) -> None:
        """From the output thread: queue `output` for the event loop and make sure a drain
        is scheduled (one at a time; a duplicate only finds nothing to do)."""
        self._undelivered.append(output)
        loop = self._loop
        if self._drain_scheduled or loop is None or loop.is_closed():
            return
        self._drain_scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """In the event loop: hand out queued steps in order, for at most
        `DELIVER_BUDGET_S`; what is left goes after the sockets had their turn."""
        self._drain_scheduled = False
        undelivered = self._undelivered
        deadline = time.monotonic() + DELIVER_BUDGET_S
        while undelivered:
            output = undelivered.popleft()
            if isinstance(output, EngineDead):
                self._on_engine_dead(output)
            else:
                self._deliver(output)
            if undelivered and time.monotonic() > deadline:
                self._drain_scheduled = True
                asyncio.get_running_loop().call_soon(self._drain)
                return

    def add_step_listener(self, listener: Callable[[StepOutputs], None]) -> None:
        """Call `listener(step)` in the event loop for every engine step (metrics)."""
        self._step_listeners.append(listener)

    def _deliver(self, step: StepOutputs) -> None:
        now = self.last_progress_at = time.monotonic()
        for listener in self._step_listeners:
            listener(step)
        if step.step_id:
            self._last_batch = {update.request_id for update in step.updates}
        processed = self._frontend.outputs.process(step)
        self._client.abort_requests(processed.to_abort)
        streams = self._streams
        for result in processed.outputs:
            request_id = result.request_id
            stream = streams.get(request_id)
            if stream is None:
                continue
            self._not_started.discard(request_id)
            if stream.crashed_at is not None:
                self._recovered_stream(request_id, stream, now)
            stream.queue.put_nowait(result)
            if (
                not stream.is_paused
                and not result.finished
                and stream.queue.qsize() >= MAX_UNDELIVERED_OUTPUTS
            ):
                self._set_paused(result.request_id, stream, True)
        for request_id, error in processed.failures:
            stream = streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait(error)
        if self._isolation.num_suspects:
            self._next_trial()

    def _recovered_stream(self, request_id: str, stream: _Stream, now: float) -> None:
        """A carried-over request's first output after the restart: its recovery time,
        and the end of its trial if it was on one."""
        assert stream.crashed_at is not None
        for listener in self._recovery_listeners:
            listener.on_stream_recovered(now - stream.crashed_at)
        stream.crashed_at = None
        if self._isolation.cleared(request_id):
            self._next_trial()

    def _on_engine_dead(self, dead: EngineDead) -> None:
        """The engine failed: restart it (`--on-engine-failure restart`, within the budget,
        never during shutdown), else fail every request (`_fail_all`)."""
        if not self._recovery.restarts or self._stopped.is_set():
            self._fail_all(dead)
            return
        now = time.monotonic()
        live = self._streams
        batch = dead.batch if dead.batch is not None else self._last_batch | self._not_started
        restart, poison = self._recovery.on_failure(
            (r for r in batch if r in live), self._not_started, now
        )
        info = dead.error
        if not restart:
            recovery = self.config.recovery
            logger.error(
                "engine.restart_budget_exhausted",
                extra={
                    "cause": info.type,
                    "failed_process": info.process,
                    "max_engine_restarts": recovery.max_engine_restarts,
                    "engine_restart_window_s": recovery.engine_restart_window,
                },
            )
            self._fail_all(dead)
            return
        self.is_recovering = True
        self.restarts += 1
        self._crash, self._crashed_at = dead, now
        self._last_batch, self._not_started = set(), set()  # of the new engine, from here
        logger.error(
            "engine.restarting",
            extra={
                "cause": info.type,
                "failed_process": info.process,
                "restart": self.restarts,
                "num_requests": len(live),
                "num_suspects": self._isolation.num_suspects,
                "poison_request_id": poison,
            },
        )
        for listener in self._recovery_listeners:
            listener.on_engine_restart(info.type)
        if poison is not None:
            self._fail_poison(poison, dead)
        for stream in live.values():
            stream.crashed_at = now
        threading.Thread(
            target=_restart_engine,
            args=(self, self._client, list(self._threads)),
            name="engine-restart",
            daemon=True,
        ).start()

    def _fail_poison(self, request_id: str, dead: EngineDead) -> None:
        """Fail the request on trial, which was in the batch of a second failure, alone."""
        info = dead.error
        logger.error(
            "request.engine_fault",
            extra={"request_id": request_id, "cause": info.type, "failed_process": info.process},
        )
        for listener in self._recovery_listeners:
            listener.on_request_poisoned()
        self._frontend.outputs.remove(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(
                RequestFailedError(
                    f"the engine failed twice with this request in the failing step "
                    f"({info.type}): it is failed alone, and the other requests go on",
                    code=ErrorCode.ENGINE_FAULT_REQUEST,
                    crash_context=dict(dead.trace_context),
                )
            )

    def _restarted(self, client: MPClient) -> None:
        """In the event loop (or the restart thread before any request bound one): the new
        engine is up; carry every in-flight request over to it."""
        if self._stopped.is_set():
            client.shutdown(graceful=False)
            return
        self._frontend.client = self._client = client
        self._start_output_thread(client)
        now = time.monotonic()
        self._restart_s = now - self._crashed_at
        self.is_recovering = False
        self.last_progress_at = now
        num_requests = num_tokens = 0
        for request_id, state in list(self._frontend.outputs.states.items()):
            stream = self._streams.get(request_id)
            if stream is None or self._isolation.is_suspect(request_id):
                continue
            num_requests += 1
            num_tokens += self._readmit(request_id, state, stream)
        num_suspects = self._isolation.num_suspects
        self._next_trial()
        logger.info(
            "engine.recovered",
            extra={
                "restart": self.restarts,
                "seconds": round(self._restart_s, 3),
                "num_requests": num_requests,
                "num_tokens": num_tokens,
                "num_suspects": num_suspects,
            },
        )
        for listener in self._recovery_listeners:
            listener.on_requests_migrated(num_requests, num_tokens)
        self._wake_waiting(None)

    def _restart_failed(self, error: BaseException) -> None:
        """The new engine did not start: the engine is dead, as without a restart."""
        crash = self._crash
        assert crash is not None
        self.is_recovering = False
        logger.error("engine.restart_failed", extra={"error_type": type(error).__name__})
        cause = getattr(error, "cause_type", type(error).__name__)
        failed = EngineDead(
            error=ErrorInfo(
                type=str(cause),
                message=f"the engine failed ({crash.error.type}) and did not start again",
                process=getattr(error, "failed_process", "") or ENGINE_CORE,
            ),
            trace_context=crash.trace_context,
        )
        self._fail_all(failed)

    def _readmit(self, request_id: str, state: RequestState, stream: _Stream) -> int:
        """Admit a carried-over request to the new engine as its prompt plus the tokens
        already sent; returns the tokens it recomputes."""
        span = stream.span
        context = inject_context(trace.set_span_in_context(span)) if span is not None else {}
        try:
            self._client.add_request(
                AddRequest(
                    request_id,
                    state.prompt_token_ids,
                    state.params,
                    state.arrival_time,
                    context,
                    output_token_ids=list(state.token_ids),
                )
            )
        except EngineDeadError:
            return 0  # the new engine died too: its EngineDead is on its way
        if stream.is_paused:
            self._client.pause_requests([request_id])
        self._not_started.add(request_id)
        num_tokens = len(state.prompt_token_ids) + len(state.token_ids)
        crash = self._crash
        if span is not None and span.is_recording() and crash is not None:
            span.add_event(
                EVENT_ENGINE_RESTARTED,
                {
                    "otel_engine.engine.restarts": self.restarts,
                    "otel_engine.engine.failure_type": crash.error.type,
                    "otel_engine.request.tokens_recomputed": num_tokens,
                },
            )
            link = link_from(crash.trace_context) if crash.trace_context else None
            if link is not None:
                span.add_link(link.context, {"otel_engine.link.reason": "engine_restarted"})
        return num_tokens

    def _next_trial(self) -> None:
        """Admit the next suspect alone (engine/recovery.py): when none is on trial and every
        other request the engine runs has produced a token, so that a failure of its first
        step names it."""
        if self.is_recovering or self.dead_error is not None:
            return
        states = self._frontend.outputs.states
        streams = self._streams
        if any(r in streams and not streams[r].is_paused for r in self._not_started):
            return
        request_id = self._isolation.next_trial(
            lambda r: r in streams and r in states, lambda r: not streams[r].is_paused
        )
        if request_id is None:
            return
        logger.info("request.on_trial", extra={"request_id": request_id})
        tokens = self._readmit(request_id, states[request_id], self._streams[request_id])
        for listener in self._recovery_listeners:
            listener.on_requests_migrated(1, tokens)

    async def _wait_for_restart(self) -> None:
        """A new request during a restart waits for it, if the wait queue has room."""
        if len(self._waiting) >= RECOVERY_WAIT_QUEUE:
            raise EngineRecoveringError(
                "the engine is restarting after a failure", retry_after_s=self._restart_s
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        finally:
            self._waiting.remove(waiter)

    def _wake_waiting(self, error: BaseException | None) -> None:
        for waiter in self._waiting:
            if waiter.done():
                continue
            if error is None:
                waiter.get_loop().call_soon_threadsafe(_set_done, waiter, None)
            else:
                waiter.get_loop().call_soon_threadsafe(_set_done, waiter, error)

    def _fail_all(self, dead: EngineDead) -> None:
        error = dead_error(dead)
        info = dead.error
        self.dead_error = error
        logger.error("engine.dead", extra={"cause": info.type, "failed_process": info.process})
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._wake_waiting(error)

    def shutdown(self) -> None:
        """Stop the engine and reap its processes; idempotent, safe from any thread."""
        self._finalizer()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pump_outputs(ref: weakref.ref[AsyncLLM], client: MPClient, stopped: threading.Event) -> None:
    """Thread `core-output-io`: receive frames, hand them to the event loop.

    Holds only a weak reference, so an AsyncLLM that is dropped can still be collected.
    """
    while not stopped.is_set():
        output = client.get_output()
        llm = ref()
        if llm is None:
            return
        if output is None and llm.stalled_for > llm.config.timeouts.step_timeout + STALL_GRACE_S:
            # The core's own watchdog did not fire (the process is frozen): give up on it.
            output = EngineDead(error=_stalled(llm.config.timeouts.step_timeout))
            client.kill(output.error)
        if output is not None:
            if llm._loop is not None:
                llm._hand_over(output)
            elif isinstance(output, EngineDead):
                # No request has run yet, so nothing waits in an event loop: the engine is
                # restarted or dead from here on (`is_dead`, /health, the server's exit), not
                # only once a first request binds a loop.
                llm._on_engine_dead(output)
            if isinstance(output, EngineDead):
                return
        del llm


def _stalled(step_timeout: float) -> ErrorInfo:
    return ErrorInfo(
        type=FailureCause.ENGINE_STALLED,
        message=f"the engine core made no progress in {step_timeout:g} s with requests "
        "pending and did not report it (see --step-timeout)",
        process=ENGINE_CORE,
    )


def _restart_engine(llm: AsyncLLM, old: MPClient, old_threads: list[threading.Thread]) -> None:
    """Thread `engine-restart`: take the failed engine's process tree down (nothing left
    behind), start a new one from the same config, and hand it to the event loop."""
    for thread in old_threads:
        thread.join(timeout=THREAD_JOIN_S)
    old.shutdown(graceful=False)
    try:
        client = MPClient(llm.config, llm._frontend.model_dir, restarts=llm.restarts)
    except Exception as exc:  # EngineStartupError, or the spawn itself failed
        _call_in_loop(llm, llm._restart_failed, exc)
        return
    if not _call_in_loop(llm, llm._restarted, client):
        client.shutdown(graceful=False)


def _call_in_loop(llm: AsyncLLM, function: Callable[..., None], argument: object) -> bool:
    """Run `function(argument)` in the engine's event loop (here when no request bound one
    yet); False when that loop is closed."""
    loop = llm._loop
    if loop is None:
        function(argument)
        return True
    try:
        loop.call_soon_threadsafe(function, argument)
    except RuntimeError:  # the loop closed
        return False
    return True


def _set_done(waiter: asyncio.Future[None], error: BaseException | None) -> None:
    if waiter.done():
        return
    if error is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(error)


def _shutdown(
    stopped: threading.Event, frontend: Frontend, threads: list[threading.Thread]
) -> None:
    stopped.set()
    for thread in list(threads):
        thread.join(timeout=THREAD_JOIN_S)
    frontend.shutdown()
