"""`StepChannel`: the engine core's end of the step path to its ranks, wherever they run.

Every rank gets the same `ModelInput` on its own input socket; rank 0 sends back the sampled
tokens (`ModelOutput`) on one results socket, and a rank that fails sends its `WorkerFailure`
there too. The channel holds those sockets and their codecs, and decides what failed: the
failure reports that arrive within a moment, and a death its executor saw (a local process's
sentinel, a Ray actor's pending call), give one root cause (`choose_root_cause`), which the
executor may refine with what only it knows (`Refine`: a Ray rank that went silent, its node).

The local and the Ray executors each own one channel and differ only in where their ranks
run and how a death is seen. `close()` gives back every socket and the context: an engine
can be torn down and started again in one process without leaking them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import zmq

from otel_engine.errors import FailureCause
from otel_engine.ipc.codec import Codec, error_info
from otel_engine.ipc.messages import (
    ErrorInfo,
    ModelInput,
    ModelOutput,
    StopWorker,
    WorkerFailure,
    WorkerRequest,
    WorkerResponse,
)
from otel_engine.ipc.process import process_title
from otel_engine.ipc.roles import ProcessRole
from otel_engine.timing import (
    FAILED_REPORT_WAIT_S,
    FAILURE_GRACE_S,
    STOP_SEND_TIMEOUT_S,
    WORKER_RESULT_POLL_S,
)

# The executor's second opinion on the cause it is given, with every report that arrived.
Refine = Callable[[ErrorInfo, list[WorkerFailure]], ErrorInfo]


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
    reporters = {process_title(ProcessRole.WORKER, f.rank) for f in failures}
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
    reporters = {process_title(ProcessRole.WORKER, f.rank) for f in failures}
    silent = died is not None and died.process not in reporters
    return silent and exit_code == 1 and waited < FAILED_REPORT_WAIT_S


class StepChannel:
    """Sockets to `tp_size` ranks (bound here, the ranks connect), and what failed."""

    def __init__(
        self,
        tp_size: int,
        results_address: str,
        input_addresses: Sequence[str],
        *,
        refine: Refine | None = None,
    ) -> None:
        """Bind the results socket at `results_address` and rank r's input socket at
        `input_addresses[r]` (a `tcp://host:*` address takes a free port: the addresses the
        ranks must connect to are `results_address` and `input_addresses` afterwards)."""
        self.tp_size = tp_size
        self._refine = refine
        self._requests: Codec[WorkerRequest] = Codec(WorkerRequest)
        self._responses: Codec[WorkerResponse] = Codec(WorkerResponse)
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._results = self.context.socket(zmq.PULL)
        self._inputs: list[zmq.Socket[bytes]] = []
        self._failure: ErrorInfo | None = None  # the first failure seen
        self._died: ErrorInfo | None = None  # a rank's death, as its executor saw it
        self._died_code: int | None = None
        self._root: ErrorInfo | None = None  # the cause, once decided
        try:
            self._results.bind(results_address)
            for address in input_addresses:
                socket = self.context.socket(zmq.PUSH)
                self._inputs.append(socket)
                socket.bind(address)
        except BaseException:
            self.close()
            raise
        self.results_address = self._results.getsockopt_string(zmq.LAST_ENDPOINT)
        self.input_addresses = [s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self._inputs]

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def rank_died(self, died: ErrorInfo, exit_code: int | None = None) -> None:
        """A rank is gone, as its executor's monitor saw it (from the monitor's thread)."""
        self._died_code, self._died = exit_code, died
        if self._failure is None:
            self._failure = died

    def execute(self, step: ModelInput) -> ModelOutput:
        """Send `step` to every rank, return rank 0's result; any failure is WorkerError."""
        self.check_health(step.step_id)
        data = self._requests.encode(step)
        for socket in self._inputs:
            socket.send(data, copy=False)
        # No deadline here: a step that hangs is the step watchdog's to end, in the process
        # that runs the step (core_proc.StepWatchdog; the caller's, for in-process engines).
        while True:
            if self._results.poll(int(WORKER_RESULT_POLL_S * 1000)):
                return self._take_result(step.step_id)
            if self._failure is not None:  # the monitor saw a rank die
                self._raise([])

    def check_health(self, next_step: int | None = None) -> None:
        """Raise WorkerError if a rank has died or reported a failure, or sent a result
        nobody asked for (before `next_step`, when one is about to run)."""
        if self._failure is None and self._results.poll(0):
            self._take_result(next_step)
        if self._failure is not None:
            self._raise([])

    def _take_result(self, step_id: int | None) -> ModelOutput:
        """The sampled tokens of `step_id` (None: no step is running). A failure report, or
        a result for another step (the core and its ranks disagree on where they are: a
        protocol bug that would otherwise look like a hang), raises WorkerError."""
        message = self._responses.decode(self._results.recv(copy=False).buffer)
        if isinstance(message, WorkerFailure):
            self._failure = self._failure or message.error
            self._raise([message])
        if message.step_id != step_id:
            waiting = "no step" if step_id is None else f"step {step_id}"
            sender = process_title(ProcessRole.WORKER, 0)  # rank 0 sends the results
            self._failure = self._root = ErrorInfo(
                type=FailureCause.STEP_MISMATCH,
                message=f"{sender} sent the result of step {message.step_id} while the "
                f"engine core was waiting for {waiting}",
                process=sender,
                rank=0,
            )
            self._raise([])
        return message

    def _raise(self, failures: list[WorkerFailure]) -> NoReturn:
        raise WorkerError(self._root_cause(failures))

    def _root_cause(self, failures: list[WorkerFailure]) -> ErrorInfo:
        """Collect the failure reports that arrive within a moment (`FAILURE_GRACE_S`, longer
        while `expects_report`), then decide once (`choose_root_cause`, then `refine`)."""
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
        root = choose_root_cause(self._died, failures, self._failure)
        self._root = self._refine(root, failures) if self._refine is not None else root
        return self._root

    def send_stop(self) -> bool:
        """Ask every rank to stop (`StopWorker`); False if one could not be told in time
        (its input queue is full: it is not reading)."""
        stop = self._requests.encode(StopWorker())
        told = True
        for socket in self._inputs:
            socket.setsockopt(zmq.SNDTIMEO, int(1000 * STOP_SEND_TIMEOUT_S))
            try:
                socket.send(stop)
            except zmq.ZMQError:
                told = False
        return told

    def close(self) -> None:
        """Close every socket and the context (nothing lingers: the ranks are gone)."""
        for socket in [*self._inputs, self._results]:
            socket.close(linger=0)
        self.context.term()
