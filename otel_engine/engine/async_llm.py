"""`AsyncLLM`: streaming generation for servers, driven from any thread's event loop.

The engine core runs in its own process. A thread (`core-output-io`) receives its outputs
and hands them to the event loop that submitted the requests; an `EngineDead` frame, or the
core's process dying, fails every in-flight request with `EngineDeadError`, or, with
`--on-engine-failure restart` and within its budget, starts a new engine core and carries
every in-flight request over to it (`Restarter`, engine/restarter.py, which sees this
engine through `RestartHost`): its consumer waits and then gets what it would have got
without the failure. Nothing here
depends on signal handlers, so it works the same outside the main thread (faulthandler,
enabled on stderr as by `LLM`, is set up from any thread too).

Backpressure: a request is paused in the engine, giving its slot and KV blocks to others,
while its consumer holds it (`hold`: the HTTP server's stream saw its client stop reading)
or has not taken `MAX_UNDELIVERED_OUTPUTS` outputs (engine/stream.py), and resumed once
neither is the case.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from opentelemetry import trace

from otel_engine.config import EngineConfig
from otel_engine.engine.core_client import MPClient
from otel_engine.engine.frontend import Frontend, dead_error
from otel_engine.engine.output import OutputProcessor
from otel_engine.engine.recovery import RecoveryListener
from otel_engine.engine.restarter import Restarter
from otel_engine.engine.stream import MAX_UNDELIVERED_OUTPUTS, RequestStream
from otel_engine.errors import EngineDeadError, FailureCause
from otel_engine.ipc.messages import EngineDead, ErrorInfo, StepOutputs
from otel_engine.ipc.native_fault import enable_on_stderr
from otel_engine.ipc.process import ENGINE_CORE
from otel_engine.observability.log_limits import RateLimitedLog
from otel_engine.outputs import RequestOutput
from otel_engine.sampling_params import SamplingParams
from otel_engine.timing import (
    CORE_OUTPUT_POLL_S,
    HEARTBEAT_TIMEOUT_S,
    STALL_GRACE_S,
    THREAD_JOIN_S,
)

logger = logging.getLogger(__name__)
# A client that reads in spurts pauses its stream again and again: a line a second at most.
_PAUSED_LOG = RateLimitedLog(logger)

T = TypeVar("T")

# The event loop hands out engine steps for at most this long before it answers sockets
# again: on a starved machine steps pile up, and handing out the whole backlog in one go
# kept `/health` waiting for hundreds of milliseconds.
DELIVER_BUDGET_S = 0.01


class AsyncLLM:
    """Asynchronous engine: `async for output in llm.generate(prompt, params, request_id)`."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        if options.get("multiprocess") is False:
            raise ValueError("AsyncLLM runs the engine core in its own process (multiprocess=True)")
        self._setup(EngineConfig.from_kwargs(model=model, **options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        """The engine of `config` (`serve`'s); its core runs in a process of its own, whatever
        `config.parallel.multiprocess` says."""
        self = cls.__new__(cls)
        self._setup(config)
        return self

    def _setup(self, config: EngineConfig) -> None:
        # the engine core is a process of its own whatever the config's default says
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, multiprocess=True)
        )
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
        self._restarter = Restarter(config.recovery, _RestartHost(self))
        self._streams: dict[str, RequestStream] = {}
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
        # what shutdown joins: the current engine's output thread and any restart's thread
        self._threads: list[threading.Thread] = []
        self._output_thread: threading.Thread | None = None
        self._start_output_thread(client)
        self._finalizer = weakref.finalize(
            self, _shutdown, self._stopped, self._frontend, self._threads
        )

    def _install_client(self, client: MPClient) -> None:
        """The engine's client from here on (a restarted engine's), with its output thread;
        progress counts from now."""
        self.last_progress_at = time.monotonic()
        self._frontend.client = self._client = client
        self._start_output_thread(client)

    def _start_output_thread(self, client: MPClient) -> None:
        thread = threading.Thread(
            target=_pump_outputs,
            args=(weakref.ref(self), client, self._stopped),
            name="core-output-io",
            daemon=True,
        )
        thread.start()
        # the old engine's output thread has ended (a restart joined it); the restart's own
        # thread, still handing this client over, stays to be joined at shutdown
        self._threads[:] = [
            t for t in self._threads if t is not self._output_thread and t.is_alive()
        ]
        self._threads.append(thread)
        self._output_thread = thread

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def is_recovering(self) -> bool:
        """A new engine is starting after a failure (`--on-engine-failure restart`)."""
        return self._restarter.is_recovering

    @property
    def restarts(self) -> int:
        return self._restarter.restarts

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
        return self._restarter.restart_s

    def add_recovery_listener(self, listener: RecoveryListener) -> None:
        """`listener` hears of every restart (metrics), in the event loop."""
        self._restarter.add_listener(listener)

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
        await self._admit(request_id, prompt, params)
        stream = RequestStream(span=trace.get_current_span())
        self._restarter.admitted(request_id)
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

    async def _admit(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> None:
        """Send the request to the engine; with restarts, first wait while a new engine
        starts or suspects wait for their trials, and wait again when the engine failed
        between (its failure reaches the event loop a moment after the send fails)."""
        restarter = self._restarter
        while True:
            while restarter.holds_new_requests:
                await restarter.wait()
            try:
                self._frontend.add_request(request_id, prompt, params)
                return
            except EngineDeadError:
                if not restarter.policy.restarts or self.dead_error is not None:
                    raise
            if self._stopped.is_set():
                raise EngineDeadError(
                    "the engine is shut down", cause_type=FailureCause.ENGINE_SHUTDOWN
                )
            await asyncio.sleep(CORE_OUTPUT_POLL_S)

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

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.is_paused:
            self.num_paused -= 1
        self._restarter.forgotten(request_id)
        return stream

    def _set_paused(self, request_id: str, stream: RequestStream, is_paused: bool) -> None:
        stream.is_paused = is_paused
        if is_paused:
            self.num_paused += 1
            self._client.pause_requests([request_id])
            _PAUSED_LOG.log(logging.INFO, "request.paused", request_id=request_id)
            self._restarter.paused(request_id, True)
            return
        if len(self._streams) == self.num_paused:
            self.last_progress_at = time.monotonic()  # work pending again from now
        self.num_paused -= 1
        self._client.resume_requests([request_id])
        self._restarter.paused(request_id, False)

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
        self._restarter.stepped(step)
        processed = self._frontend.outputs.process(step)
        self._client.abort_requests(processed.to_abort)
        streams = self._streams
        for result in processed.outputs:
            request_id = result.request_id
            stream = streams.get(request_id)
            if stream is None:
                continue
            self._restarter.produced(request_id, stream, now)
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
        self._restarter.next_trial()

    def _on_engine_dead(self, dead: EngineDead) -> None:
        """The engine failed: restarted (`Restarter`), or dead."""
        if not self._restarter.on_engine_dead(dead):
            self._fail_all(dead)

    def _fail_all(self, dead: EngineDead) -> None:
        """The engine is dead: every request fails with `dead`'s error."""
        error = dead_error(dead)
        info = dead.error
        self.dead_error = error
        logger.error("engine.dead", extra={"cause": info.type, "failed_process": info.process})
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._restarter.wake(error)

    def shutdown(self) -> None:
        """Stop the engine and reap its processes; idempotent, safe from any thread."""
        self._finalizer()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _RestartHost:
    """What `AsyncLLM` shows its `Restarter` (engine/restarter.py's `RestartHost`)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    @property
    def streams(self) -> Mapping[str, RequestStream]:
        return self._llm._streams

    @property
    def outputs(self) -> OutputProcessor:
        return self._llm._frontend.outputs

    @property
    def client(self) -> MPClient:
        return self._llm._client

    @property
    def threads(self) -> list[threading.Thread]:
        return self._llm._threads

    @property
    def is_stopped(self) -> bool:
        return self._llm._stopped.is_set()

    @property
    def is_dead(self) -> bool:
        return self._llm.is_dead

    def next_client(self, restarts: int) -> MPClient:
        return self._llm._frontend.next_client(restarts)

    def install_client(self, client: MPClient) -> None:
        self._llm._install_client(client)

    def fail_all(self, dead: EngineDead) -> None:
        self._llm._fail_all(dead)

    def call_in_loop(self, function: Callable[[T], None], argument: T) -> bool:
        loop = self._llm._loop
        if loop is None:
            function(argument)
            return True
        try:
            loop.call_soon_threadsafe(function, argument)
        except RuntimeError:  # the loop closed
            return False
        return True


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


def _shutdown(
    stopped: threading.Event, frontend: Frontend, threads: list[threading.Thread]
) -> None:
    stopped.set()
    for thread in list(threads):
        thread.join(timeout=THREAD_JOIN_S)
    frontend.shutdown()
