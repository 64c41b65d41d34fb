"""The rules of `--on-engine-failure restart` (engine/restarter.py carries them out): the
restart budget, the suspects of a request that kills the engine, and what a restart tells
the server's metrics.

**Poison requests.** A failure that follows one request (a kernel fault on its shape) would
come back after every restart. Such a request fails at its first step, so the suspects of
a failure are the requests of its batch that had not produced a token since they were
admitted; a failure in a batch where every request had one (a step of decodes: SIGKILL, the
OOM killer, a hang) has none. After the restart, suspects go on trial one at a time, each
alone among requests that have all produced a token (new requests wait meanwhile). A
failure of the same type, in the same process (for a death: the same way of dying,
`failure_signature`), whose batch holds the request on trial as
its only request without a token, is that request's second: it fails alone
(`engine_fault_request`), and the restart budget does not count that failure. A trial that
fails another way (the request came to be a suspect in the batch of an unrelated failure)
makes that failure the one a verdict needs: such a poison request is failed after two
failures of its own, never tried forever. Such failures
are bounded on their own, by as many again as the budget in the same window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

from otel_engine.config import EngineFailureMode, RecoveryConfig
from otel_engine.errors import FailureCause
from otel_engine.ipc.messages import ErrorInfo

# Requests that may wait for a restart to end; past that, new ones get 503 with Retry-After.
RECOVERY_WAIT_QUEUE = 64


def failure_signature(info: ErrorInfo) -> str:
    """Which failure `info` is, for a verdict: its type and process, and for a death how the
    process died ("was killed by signal 9", "exited with code 3", "died of SIGSEGV in
    <function> at <file>:<line>"), so that an outside SIGKILL and an exit, both deaths of
    the engine core, are two failures. An exception's message is left out: it may name the
    step."""
    where = f"{info.type} in {info.process}"
    is_death = info.type in {c.value for c in FailureCause if c.how == "died"}
    return f"{where}: {info.message}" if is_death else where


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Count one restart at `now` if the budget has room; False when it has none."""
        times = self._times
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        return True


class Isolation:
    """Which carried-over requests are suspects, and which one is on trial."""

    def __init__(self) -> None:
        self._suspects: deque[str] = deque()
        self._suspected: set[str] = set()
        self._failures: dict[str, str] = {}  # suspect -> the failure that made it one
        self.on_trial: str | None = None

    def blame(self, batch: Iterable[str], unproven: Collection[str], failure: str) -> str | None:
        """At a failure (`failure`: its type and process) whose step ran `batch`: the poison
        to fail alone, or None.

        `unproven` are the requests that had not produced a token since they were admitted
        to the failed engine: a request that kills the engine does so at its first step. The
        request on trial is the poison when it is the only unproven one in the batch and
        the failure is the one that made it a suspect (or, after a trial that failed
        another way, that failure). The batch's other unproven requests become suspects; a
        request on trial that is not the poison waits for its trial again, first."""
        new = [request_id for request_id in batch if request_id in unproven]
        on_trial = self.on_trial
        is_same = on_trial is not None and self._failures.get(on_trial) == failure
        poison = on_trial if is_same and new == [on_trial] else None
        self.on_trial = None
        if on_trial is not None and poison is None:
            self._suspects.appendleft(on_trial)
            self._suspected.add(on_trial)
            if on_trial in new:  # its trial failed another way: the next verdict needs this one
                self._failures[on_trial] = failure
        if poison is not None:
            del self._failures[poison]
        for request_id in new:
            if request_id != poison and request_id not in self._suspected:
                self._suspects.append(request_id)
                self._suspected.add(request_id)
                self._failures[request_id] = failure
        return poison

    def is_suspect(self, request_id: str) -> bool:
        return request_id in self._suspected or request_id == self.on_trial

    @property
    def num_suspects(self) -> int:
        return len(self._suspected) + (self.on_trial is not None)

    def has_ready(self, is_ready: Callable[[str], bool]) -> bool:
        """Whether a suspect could go on trial now (one its client holds cannot)."""
        return any(is_ready(request_id) for request_id in self._suspects)

    def next_trial(
        self, is_live: Callable[[str], bool], is_ready: Callable[[str], bool] | None = None
    ) -> str | None:
        """The next suspect to admit alone (None: none is ready, or one is on trial). Ended
        requests leave the queue; one not ready (its client holds it) keeps its place."""
        if self.on_trial is not None:
            return None
        for request_id in list(self._suspects):
            if not is_live(request_id):
                self.forget(request_id)
            elif is_ready is None or is_ready(request_id):
                self._suspected.discard(request_id)
                self._suspects.remove(request_id)
                self.on_trial = request_id
                return request_id
        return None

    def cleared(self, request_id: str) -> bool:
        """`request_id` produced a token (or ended): True if that ends its trial."""
        if request_id != self.on_trial:
            return False
        self.on_trial = None
        self._failures.pop(request_id, None)
        return True

    def forget(self, request_id: str) -> None:
        """The request ended (its client went away, or it failed)."""
        if request_id in self._suspected:
            self._suspected.discard(request_id)
            self._suspects.remove(request_id)
        elif request_id == self.on_trial:
            self.on_trial = None
        self._failures.pop(request_id, None)


class RecoveryPolicy:
    """Whether a failure restarts the engine, and the request it is pinned on, if any."""

    def __init__(self, config: RecoveryConfig) -> None:
        self.config = config
        self.isolation = Isolation()
        self._budget = RestartBudget(config.max_engine_restarts, config.engine_restart_window)
        # failures pinned on a poison request: not charged to `_budget`, but bounded
        self._forgiven = RestartBudget(config.max_engine_restarts, config.engine_restart_window)

    @property
    def restarts(self) -> bool:
        return self.config.on_engine_failure == EngineFailureMode.RESTART

    def on_failure(
        self, batch: Iterable[str], unproven: Collection[str], failure: str, now: float
    ) -> tuple[bool, str | None]:
        """At a failure whose step ran `batch` (the live requests of it; `unproven` and
        `failure` as for `Isolation.blame`): whether to restart (within the budget), and
        the poison request to fail alone (or None)."""
        poison = self.isolation.blame(batch, unproven, failure)
        is_forgiven = poison is not None and self._forgiven.take(now)
        return is_forgiven or self._budget.take(now), poison


class RecoveryListener(Protocol):
    """What the server's metrics hear of restarts (`EngineMetrics` is one)."""

    def on_engine_restart(self, cause: str) -> None:
        """The engine failed and is being restarted; `cause` is its failure's type."""

    def on_requests_migrated(self, num_requests: int, num_tokens: int) -> None:
        """Requests admitted again after a restart, with the tokens they recompute."""

    def on_stream_recovered(self, seconds: float) -> None:
        """A carried-over request's first token after the restart, `seconds` after the
        failure."""

    def on_request_poisoned(self) -> None:
        """A request failed alone as the poison of two failures."""
