"""Restarts in place for the server's engine (`--on-engine-failure restart`): what `AsyncLLM`
does when its engine core fails, carried out here; the rules (the budget, the suspects of
a poison request) are engine/recovery.py's.

Within the budget, every client's stream stays open; thread `engine-restart` takes the
failed engine's process tree down and starts a new engine core from the same config; back
in the event loop, each unfinished request is admitted to it again as its prompt plus the
tokens its client already got (`AddRequest.output_token_ids`), which the core recomputes as
after a preemption. The suspects follow one at a time, new requests waiting meanwhile.
`Restarter` is `AsyncLLM`'s collaborator, and sees of that engine only what `RestartHost`
declares: its streams and output states, its client, which a restart replaces, and its
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from opentelemetry import trace

from otel_engine.config import RecoveryConfig
from otel_engine.engine.core_client import MPClient
from otel_engine.engine.output import OutputProcessor, RequestState
from otel_engine.engine.recovery import (
    RECOVERY_WAIT_QUEUE,
    RecoveryListener,
    RecoveryPolicy,
    failure_signature,
)
from otel_engine.engine.stream import RequestStream
from otel_engine.errors import (
    EngineDeadError,
    EngineRecoveringError,
    ErrorCode,
    FailureCause,
    RequestFailedError,
)
from otel_engine.ipc.messages import AddRequest, EngineDead, ErrorInfo, StepOutputs
from otel_engine.ipc.process import ENGINE_CORE
from otel_engine.observability.tracing import inject_context, link_from
from otel_engine.timing import RETRY_AFTER_FIRST_RESTART_S, THREAD_JOIN_S

logger = logging.getLogger(__name__)

# The span event of a request carried over to a restarted engine (linked to the crash).
EVENT_ENGINE_RESTARTED = "otel_engine.request.engine_restarted"

T = TypeVar("T")


class RestartHost(Protocol):
    """What `Restarter` needs of the engine it restarts; `AsyncLLM` gives it one."""

    @property
    def streams(self) -> Mapping[str, RequestStream]:
        """The in-flight requests' streams, by request id."""

    @property
    def outputs(self) -> OutputProcessor:
        """Their output states: prompt, parameters and the tokens their clients got."""

    @property
    def client(self) -> MPClient:
        """The current engine core's client."""

    @property
    def threads(self) -> list[threading.Thread]:
        """The threads shutdown joins: the current engine's output thread, and a restart's
        own thread once it adds it."""

    @property
    def is_stopped(self) -> bool:
        """The engine is shut down, or shutting down."""

    @property
    def is_dead(self) -> bool:
        """The engine failed for good: every request was failed."""

    def next_client(self, restarts: int) -> MPClient:
        """Start a new engine core (`restarts` were started before it); from any thread."""

    def install_client(self, client: MPClient) -> None:
        """The engine's client from here on, with its output thread; progress counts from
        now."""

    def fail_all(self, dead: EngineDead) -> None:
        """The engine is dead: fail every request with `dead`'s error."""

    def call_in_loop(self, function: Callable[[T], None], argument: T) -> bool:
        """Run `function(argument)` in the engine's event loop (here when no request bound
        one yet); False when that loop is closed."""


class Restarter:
    """The restarts of one `AsyncLLM`; every method runs in its event loop, but for those
    the restart thread calls before a first request bound one."""

    def __init__(self, config: RecoveryConfig, host: RestartHost) -> None:
        self._host = host
        self.policy = RecoveryPolicy(config)
        self.isolation = self.policy.isolation
        self.restarts = 0  # engines started after a failure
        self.is_recovering = False
        self.restart_s = RETRY_AFTER_FIRST_RESTART_S  # how long the last restart took
        self._crash: EngineDead | None = None  # the failure being recovered from
        self._crashed_at = 0.0
        self._waiting: list[asyncio.Future[None]] = []  # new requests waiting for a restart
        self._listeners: list[RecoveryListener] = []
        # Requests admitted to the current engine that have not produced a token since (a
        # poison fails at its first step), and the requests of the last step heard of: the
        # account of the batch of a core that died without a word.
        self._not_started: set[str] = set()
        self._last_batch: set[str] = set()

    def add_listener(self, listener: RecoveryListener) -> None:
        self._listeners.append(listener)

    @property
    def holds_new_requests(self) -> bool:
        """New requests wait: a new engine is starting, or a suspect is on trial or could
        go on one (trials run among requests that have all produced a token); a suspect
        its client holds holds nobody back."""
        if self.is_recovering or self.isolation.on_trial is not None:
            return True
        return self.isolation.num_suspects > 0 and self.isolation.has_ready(self._is_ready)

    def _is_ready(self, request_id: str) -> bool:
        stream = self._host.streams.get(request_id)
        return stream is not None and not stream.is_paused

    # What the engine tells it.

    def admitted(self, request_id: str) -> None:
        self._not_started.add(request_id)

    def stepped(self, step: StepOutputs) -> None:
        if step.step_id:
            self._last_batch = {update.request_id for update in step.updates}

    def produced(self, request_id: str, stream: RequestStream, now: float) -> None:
        """A request's output arrived: it has been through a step; for a carried-over one,
        its recovery time, and the end of its trial if it was on one."""
        self._not_started.discard(request_id)
        if stream.crashed_at is None:
            return
        for listener in self._listeners:
            listener.on_stream_recovered(now - stream.crashed_at)
        stream.crashed_at = None
        self.isolation.cleared(request_id)

    def forgotten(self, request_id: str) -> None:
        """A request ended, whatever way."""
        self._not_started.discard(request_id)
        self.isolation.forget(request_id)
        self.next_trial()

    def paused(self, request_id: str, is_paused: bool) -> None:
        """Its consumer paused or resumed it: a paused request on trial ends its trial (it
        cannot produce a token), and a trial may start."""
        if is_paused:
            self.isolation.cleared(request_id)
        self.next_trial()

    # A failure.

    def on_engine_dead(self, dead: EngineDead) -> bool:
        """The engine failed: True when it is being restarted (within the budget, never
        during shutdown); False when the engine is dead (`AsyncLLM` fails every request)."""
        host = self._host
        if not self.policy.restarts or host.is_stopped:
            return False
        now = time.monotonic()
        live = host.streams
        batch = dead.batch if dead.batch is not None else self._last_batch | self._not_started
        info = dead.error
        restart, poison = self.policy.on_failure(
            [r for r in batch if r in live],
            self._not_started,
            failure_signature(info),
            now,
        )
        if not restart:
            recovery = self.policy.config
            logger.error(
                "engine.restart_budget_exhausted",
                extra={
                    "cause": info.type,
                    "failed_process": info.process,
                    "max_engine_restarts": recovery.max_engine_restarts,
                    "engine_restart_window_s": recovery.engine_restart_window,
                },
            )
            return False
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
                "num_suspects": self.isolation.num_suspects,
                "poison_request_id": poison,
            },
        )
        for listener in self._listeners:
            listener.on_engine_restart(info.type)
        if poison is not None:
            self._fail_poison(poison, dead)
        for stream in live.values():
            stream.crashed_at = now
        old = host.client
        old.retire()  # nothing is sent to it from here; the restart thread shuts it down
        thread = threading.Thread(
            target=_restart_engine,
            args=(self, host, old, list(host.threads)),
            name="engine-restart",
            daemon=True,
        )
        host.threads.append(thread)  # joined at shutdown, with the output thread
        thread.start()
        return True

    def _fail_poison(self, request_id: str, dead: EngineDead) -> None:
        """Fail the request on trial, which was in the batch of a second failure, alone."""
        host = self._host
        info = dead.error
        logger.error(
            "request.engine_fault",
            extra={"request_id": request_id, "cause": info.type, "failed_process": info.process},
        )
        for listener in self._listeners:
            listener.on_request_poisoned()
        host.outputs.remove(request_id)
        stream = host.streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(
                RequestFailedError(
                    f"the engine failed twice with this request in the failing step "
                    f"({info.type}): it is failed alone, and the other requests go on",
                    code=ErrorCode.ENGINE_FAULT_REQUEST,
                    crash_context=dict(dead.trace_context),
                    cause_type=info.type,
                )
            )

    # The new engine.

    def restarted(self, client: MPClient) -> None:
        """The new engine is up: carry every in-flight request over to it."""
        host = self._host
        if host.is_stopped:
            client.shutdown(graceful=False)
            self.is_recovering = False
            self.wake(
                EngineDeadError("the engine is shut down", cause_type=FailureCause.ENGINE_SHUTDOWN)
            )
            return
        host.install_client(client)
        self.restart_s = time.monotonic() - self._crashed_at
        self.is_recovering = False
        num_requests = num_tokens = 0
        for request_id, state in list(host.outputs.states.items()):
            stream = host.streams.get(request_id)
            if stream is None or self.isolation.is_suspect(request_id):
                continue
            num_requests += 1
            num_tokens += self._readmit(request_id, state, stream)
        num_suspects = self.isolation.num_suspects
        self.next_trial()
        logger.info(
            "engine.recovered",
            extra={
                "restart": self.restarts,
                "seconds": round(self.restart_s, 3),
                "num_requests": num_requests,
                "num_tokens": num_tokens,
                "num_suspects": num_suspects,
            },
        )
        for listener in self._listeners:
            listener.on_requests_migrated(num_requests, num_tokens)
        self.wake(None)

    def restart_failed(self, error: BaseException) -> None:
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
        self._host.fail_all(failed)

    def _readmit(self, request_id: str, state: RequestState, stream: RequestStream) -> int:
        """Admit a carried-over request to the new engine as its prompt plus the tokens
        already sent; returns the tokens it recomputes."""
        client = self._host.client
        span = stream.span
        context = inject_context(trace.set_span_in_context(span)) if span is not None else {}
        try:
            client.add_request(
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
            client.pause_requests([request_id])
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

    def next_trial(self) -> None:
        """Admit the next suspect alone (engine/recovery.py): when none is on trial and every
        other request the engine runs has produced a token, so that a failure of its first
        step names it."""
        host = self._host
        if self.is_recovering or host.is_dead:
            return
        states = host.outputs.states
        streams = host.streams
        if self.isolation.num_suspects and any(
            r in streams and not streams[r].is_paused for r in self._not_started
        ):
            return  # a trial waits for every request in the engine to have a token
        request_id = self.isolation.next_trial(
            lambda r: r in streams and r in states, self._is_ready
        )
        if request_id is None:
            if self._waiting and not self.holds_new_requests:
                self.wake(None)  # no trial to run: the requests held for it go on
            return
        logger.info("request.on_trial", extra={"request_id": request_id})
        tokens = self._readmit(request_id, states[request_id], streams[request_id])
        for listener in self._listeners:
            listener.on_requests_migrated(1, tokens)

    # New requests during a restart.

    async def wait(self) -> None:
        """A new request during a restart waits for it, if the wait queue has room."""
        if len(self._waiting) >= RECOVERY_WAIT_QUEUE:
            raise EngineRecoveringError(
                "the engine is restarting after a failure", retry_after_s=self.restart_s
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        finally:
            self._waiting.remove(waiter)

    def wake(self, error: BaseException | None) -> None:
        """Let the waiting requests go on (`error`: fail them); safe from any thread."""
        for waiter in self._waiting:
            if not waiter.done():
                waiter.get_loop().call_soon_threadsafe(_set_done, waiter, error)


def _restart_engine(
    restarter: Restarter,
    host: RestartHost,
    old: MPClient,
    old_threads: list[threading.Thread],
) -> None:
    """Thread `engine-restart`: take the failed engine's process tree down (nothing left
    behind), start a new one from the same config, and hand it to the event loop."""
    for thread in old_threads:
        thread.join(timeout=THREAD_JOIN_S)
    old.shutdown(graceful=False)
    try:
        client = host.next_client(restarter.restarts)
    except Exception as exc:  # EngineStartupError, or the spawn itself failed
        host.call_in_loop(restarter.restart_failed, exc)
        return
    if host.is_stopped or not host.call_in_loop(restarter.restarted, client):
        client.shutdown(graceful=False)  # the engine was shut down meanwhile


def _set_done(waiter: asyncio.Future[None], error: BaseException | None) -> None:
    if waiter.done():
        return
    if error is None:
        waiter.set_result(None)
    else:
        waiter.set_exception(error)
