"""The chaos drill behind `bench/chaos.py` and tests/failures/test_ledger.py.

`run_chaos` serves a model with `otel-engine serve` (and an OTLP receiver for its spans) and
runs `num_clients` clients (`chaos_load.py`: every kind of request, client aborts and slow
readers) for `duration_s` while faults fire:

- `restart` mode: one server with `--on-engine-failure restart`; `OTEL_ENGINE_FAULT` is a list
  with one random fault (where, kind, rank, step) for each engine the server will start
  (`restart=K`), and a poison (`worker:raise:when=prompt_len>=N`, in every engine) that one
  request with a longer prompt than every other triggers now and then; every few seconds a
  SIGKILL or SIGSEGV to the engine core or a worker, found by its title.
- `shutdown` mode: a sequence of server lives with the default `--on-engine-failure
  shutdown`; each life gets one random fault (injected, or a signal from outside), fails
  every unfinished request with `engine_dead` and exits 1, and the next life starts.

Then: the fault-free output of every deterministic body (a server without faults), the
ledger (`ledger.reconcile`), the comparison of every completed answer with the fault-free
one, the processes left behind, and the api_server's fds, threads and RSS over its life.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from otel_engine.config import EngineFailureMode
from otel_engine.observability.faults import KERNEL_FAULTS, FaultKind
from tests.helpers.chaos_load import CLIENT_KINDS, RequestKind, body_pool, new_trace_id, send
from tests.helpers.ledger import (
    Comparison,
    Ledger,
    Sent,
    compare_outputs,
    log_records,
    metric_outcomes,
    reconcile,
    request_spans,
)
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.procs import ProcessWatch, ServerProcess, is_alive, title

RESTART = EngineFailureMode.RESTART
SHUTDOWN = EngineFailureMode.SHUTDOWN
POISON = "worker:raise"  # the poison's fault; the random faults never use it
CORE_KINDS = (FaultKind.RAISE, FaultKind.OOM, FaultKind.EXIT, FaultKind.SEGFAULT, FaultKind.HANG)
WORKER_KINDS = (
    FaultKind.OOM,
    FaultKind.EXIT,
    FaultKind.SEGFAULT,
    FaultKind.HANG,
    *KERNEL_FAULTS,
)
KILL_SIGNALS = (signal.SIGKILL, signal.SIGSEGV)
STARTUP_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 30.0  # for the server to count the last requests (an abort it notices late)


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run."""

    model_dir: str
    mode: EngineFailureMode
    duration_s: float
    num_clients: int = 16
    tensor_parallel_size: int = 1
    seed: int = 0
    steps: tuple[int, int] = (10, 120)  # a random fault's step in its engine
    kill_every_s: tuple[float, float] = (10.0, 30.0)  # restart mode: signals from outside
    poison_every_s: float = 30.0  # restart mode: 0 for no poison request
    poison_words: int = 400  # longer than every other prompt (and than `poison_len`)
    poison_len: int = 700  # the poison fault's prompt_len threshold
    step_timeout_s: float = 5.0  # a `hang` fault's detection
    num_per_kind: int = 3
    server_args: tuple[str, ...] = ()


@dataclass
class Life:
    """One server process of the run and what it saw."""

    index: int
    server: ServerProcess
    watch: ProcessWatch
    http: httpx.AsyncClient
    fault: str  # its OTEL_ENGINE_FAULT, or the signal sent from outside
    metrics_start: Counter[tuple[str, str]] = field(default_factory=Counter)
    metrics_end: Counter[tuple[str, str]] = field(default_factory=Counter)
    is_dead: bool = False  # clients send it nothing more
    has_died: bool = False  # its engine died (shutdown mode): it exits by itself
    num_in_flight: int = 0
    num_sent: int = 0
    resources: list[dict[str, float]] = field(default_factory=list)
    exit_code: int | None = None


@dataclass
class ChaosResult:
    """What `bench/chaos.py` prints and the test asserts."""

    config: ChaosConfig
    sent: list[Sent]
    num_not_sent: int  # refused at connect: no server was listening
    faults: Counter[str]
    num_restarts: int
    num_poison_verdicts: int
    ledger: Ledger
    comparison: Comparison
    unexpected: list[str]  # failures the mode does not allow
    innocents: list[str]  # requests failed as a poison that were not the poison
    leftovers: list[str]
    resources: list[dict[str, float]]
    exit_codes: list[int | None]
    wall_s: float

    @property
    def num_lost(self) -> int:
        return sum(s.lost is not None for s in self.sent)

    @property
    def is_clean(self) -> bool:
        return not (
            self.ledger.num_mismatches
            or self.num_lost
            or self.comparison.num_different
            or self.unexpected
            or self.leftovers
        )


def _random_fault(rng: random.Random, config: ChaosConfig, restart: int | None) -> str:
    step = rng.randint(*config.steps)
    if rng.random() < 0.3:
        kind = rng.choice(CORE_KINDS)
        spec = f"engine_core:{kind}:step={step}"
    else:
        rank = rng.randrange(config.tensor_parallel_size)
        spec = f"worker:{rng.choice(WORKER_KINDS)}:rank={rank}:step={step}"
    return spec if restart is None else f"{spec}:restart={restart}"


def restart_faults(rng: random.Random, config: ChaosConfig, num_engines: int) -> str:
    """`OTEL_ENGINE_FAULT` of a restart-mode run: a random fault per engine, and the poison."""
    faults = [_random_fault(rng, config, k) for k in range(num_engines)]
    if config.poison_every_s:
        faults.append(f"{POISON}:when=prompt_len>={config.poison_len}")
    return ";".join(faults)


class Chaos:
    """The state of one run: the lives, the clients' records, the faults from outside."""

    def __init__(self, config: ChaosConfig, receiver: OtlpReceiver) -> None:
        self.config = config
        self.receiver = receiver
        self.rng = random.Random(config.seed)
        self.pool = body_pool(config.seed, config.num_per_kind, config.poison_words)
        self.lives: list[Life] = []
        self.sent: list[Sent] = []
        self.num_not_sent = 0
        self.kills: Counter[str] = Counter()
        self.life: Life | None = None
        self.serving = asyncio.Event()
        self.deadline = 0.0

    # Server lives.

    def _args(self, mode: EngineFailureMode) -> list[str]:
        config = self.config
        args = ["--model", config.model_dir, "--log-level", "INFO"]
        args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
        args += ["--on-engine-failure", mode, "--step-timeout", str(config.step_timeout_s)]
        args += ["--otlp-endpoint", self.receiver.endpoint, "--otlp-protocol", "grpc"]
        if mode is RESTART:
            args += ["--max-engine-restarts", "100000", "--engine-restart-window", "1"]
        else:
            args += ["--final-scrape-wait", "60"]
        return [*args, *config.server_args]

    async def start_life(self, mode: EngineFailureMode, fault: str, env_fault: bool) -> Life:
        env = {"OTEL_ENGINE_FAULT": fault} if env_fault else {}
        server = ServerProcess(self._args(mode), env=env).start()
        watch = ProcessWatch(server.pid)
        watch.seen[server.pid] = psutil.Process(server.pid)
        http = httpx.AsyncClient(
            base_url=server.base_url,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            trust_env=False,
        )
        life = Life(len(self.lives), server, watch, http, fault)
        self.lives.append(life)
        await asyncio.to_thread(server.wait_healthy, STARTUP_TIMEOUT_S)
        life.metrics_start = await self._scrape(life) or Counter()
        life.resources.append(api_resources(server.pid))
        self.life = life
        self.serving.set()
        return life

    async def _scrape(self, life: Life) -> Counter[tuple[str, str]] | None:
        try:
            response = await life.http.get("/metrics")
        except httpx.HTTPError:
            return None
        return metric_outcomes(response.text) if response.status_code == 200 else None

    async def _settled_metrics(self, life: Life) -> None:
        """Once every client of this life has its answer: the outcome counters, scraped
        until they count every request that reached it (or the server exited)."""
        while life.num_in_flight:  # noqa: ASYNC110 (a count, not one event)
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while time.monotonic() < deadline:
            scraped = await self._scrape(life)
            if scraped is not None:
                life.metrics_end = scraped
                counted = sum((scraped - life.metrics_start).values()) >= life.num_sent
                if counted and not life.has_died:
                    return
            elif life.server.returncode is not None:
                return  # the last scrape before its exit holds every request
            await asyncio.sleep(0.2)

    async def end_life(self, life: Life) -> None:
        """Stop it (SIGTERM, unless it exits by itself) and wait for it and its children."""
        self.serving.clear()
        life.is_dead = True
        await self._settled_metrics(life)
        with contextlib.suppress(psutil.Error):
            life.resources.append(api_resources(life.server.pid))
        if life.server.returncode is None and not life.has_died:
            life.server.terminate()
        try:
            life.exit_code = await asyncio.to_thread(life.server.wait, 90)
        except Exception:
            life.server.kill()
            life.exit_code = await asyncio.to_thread(life.server.wait, 30)
        life.watch.stop()
        await life.http.aclose()

    # The tasks of a run.

    async def client(self, number: int) -> None:
        rng = random.Random(f"{self.config.seed}-client-{number}")
        compared = [i for i, (kind, _) in enumerate(self.pool) if kind in CLIENT_KINDS]
        while time.monotonic() < self.deadline:
            await self.serving.wait()
            life = self.life
            if life is None or life.is_dead:
                await asyncio.sleep(0.05)
                continue
            index = rng.choice(compared)
            await self._send(life, index, rng)

    async def poisoner(self) -> None:
        rng = random.Random(f"{self.config.seed}-poison")
        index = next(i for i, (kind, _) in enumerate(self.pool) if kind is RequestKind.POISON)
        while time.monotonic() + self.config.poison_every_s < self.deadline:
            await asyncio.sleep(self.config.poison_every_s * rng.uniform(0.5, 1.5))
            life = self.life
            if life is not None and not life.is_dead:
                await self._send(life, index, rng)

    async def _send(self, life: Life, index: int, rng: random.Random) -> None:
        kind, body = self.pool[index]
        sent = Sent(new_trace_id(), kind, index, life.index, is_stream="stream" in body)
        hang_up = rng.randint(1, 4) if kind is RequestKind.ABORT else None
        life.num_in_flight += 1
        try:
            await send(life.http, body, sent, hang_up)
        finally:
            life.num_in_flight -= 1
        if sent.lost is not None and sent.lost.startswith("ConnectError") and life.has_died:
            self.num_not_sent += 1  # no server listened: it never reached one
            return
        life.num_sent += 1
        self.sent.append(sent)
        code = (sent.error or {}).get("code")
        if code == "engine_dead" and self.config.mode is SHUTDOWN:
            life.is_dead = life.has_died = True
            self.serving.clear()
        elif code == "engine_recovering":
            await asyncio.sleep(1.0)  # its Retry-After

    async def kill(self, life: Life, rng: random.Random) -> bool:
        """SIGKILL or SIGSEGV to the engine core or a worker of a ready engine: the process
        is found first and killed only if the server is ready after that, so that a signal
        never hits an engine that is still starting (a failed restart ends the server, as
        documented, which is not what this drill counts)."""
        names = ["otel-engine-core"]
        if self.config.tensor_parallel_size > 1:
            names += [f"otel-worker-{r}" for r in range(self.config.tensor_parallel_size)]
        name = rng.choice(names)
        signum = rng.choice(KILL_SIGNALS)
        try:
            target = await asyncio.to_thread(life.watch.find, name, 5.0)
            health = await life.http.get("/health")
            if health.status_code != 200:
                return False
            os.kill(target.pid, signum)
        except (AssertionError, ProcessLookupError, httpx.HTTPError):
            return False
        self.kills[f"{signal.Signals(signum).name} {name}"] += 1
        return True

    async def killer(self, life: Life) -> None:
        rng = random.Random(f"{self.config.seed}-kill")
        while True:
            await asyncio.sleep(rng.uniform(*self.config.kill_every_s))
            if time.monotonic() > self.deadline - 5:
                return
            await self.kill(life, rng)

    async def run_restart(self) -> None:
        config = self.config
        num_engines = int(config.duration_s) + 10  # more than can fail in the time
        faults = restart_faults(self.rng, config, num_engines)
        life = await self.start_life(RESTART, faults, env_fault=True)
        self.deadline = time.monotonic() + config.duration_s
        tasks = [self.client(n) for n in range(config.num_clients)]
        if config.poison_every_s:
            tasks.append(self.poisoner())
        await asyncio.gather(*tasks, self.killer(life), self._sample(life))
        await self.end_life(life)

    async def run_shutdown(self) -> None:
        config = self.config
        self.deadline = time.monotonic() + config.duration_s
        clients = asyncio.gather(*(self.client(n) for n in range(config.num_clients)))
        while time.monotonic() < self.deadline:
            life = await self.start_life(*self._shutdown_fault())
            await self._watch_life(life)
            await self.end_life(life)
        self.serving.set()  # the clients see the deadline
        await clients

    def _shutdown_fault(self) -> tuple[EngineFailureMode, str, bool]:
        if self.rng.random() < 0.3:
            return SHUTDOWN, "signal", False
        return SHUTDOWN, _random_fault(self.rng, self.config, None), True

    async def _watch_life(self, life: Life) -> None:
        """Until its engine dies (a signal from outside after a few seconds if its fault is
        one) or the run's time is up."""
        kill_at = time.monotonic() + self.rng.uniform(2.0, 8.0)
        while not life.is_dead and time.monotonic() < self.deadline:
            if life.fault == "signal" and time.monotonic() > kill_at:
                kill_at = float("inf") if await self.kill(life, self.rng) else kill_at
            if life.server.returncode is not None:
                life.is_dead = life.has_died = True
            await asyncio.sleep(0.1)

    async def _sample(self, life: Life) -> None:
        while time.monotonic() < self.deadline:
            await asyncio.sleep(min(30.0, max(1.0, self.deadline - time.monotonic())))
            with contextlib.suppress(psutil.Error):
                life.resources.append(api_resources(life.server.pid))


def api_resources(pid: int) -> dict[str, float]:
    """The api_server's open fds, threads and RSS (MiB) now."""
    proc = psutil.Process(pid)
    return {
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
        "rss_mib": round(proc.memory_info().rss / 2**20, 1),
    }


async def _reference(config: ChaosConfig, pool: list[tuple[RequestKind, Any]]) -> dict[int, Any]:
    """Each deterministic body's output from a server where nothing fails."""
    args = ["--model", config.model_dir, "--tensor-parallel-size"]
    server = ServerProcess([*args, str(config.tensor_parallel_size), *config.server_args])
    server.start()
    try:
        await asyncio.to_thread(server.wait_healthy, STARTUP_TIMEOUT_S)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=httpx.Timeout(None, connect=10.0), trust_env=False
        ) as http:
            indices = [i for i, (kind, _) in enumerate(pool) if kind.is_compared]
            sent = [
                Sent(new_trace_id(), pool[i][0], i, -1, is_stream="stream" in pool[i][1])
                for i in indices
            ]
            await asyncio.gather(*(send(http, pool[s.body_index][1], s) for s in sent))
    finally:
        server.terminate()
        await asyncio.to_thread(server.wait, 60)
        server.cleanup()
    return {s.body_index: s.output for s in sent if s.outcome is not None}


def _unexpected(config: ChaosConfig, sent: list[Sent]) -> list[str]:
    """Failures the mode does not allow: with restart, any but a verdict of the isolation
    (`engine_fault_request`) and a 503 while the restart's wait queue is full; with
    shutdown, any but engine_dead."""
    allowed = {"engine_dead"} if config.mode is SHUTDOWN else {"engine_recovering"}
    if config.mode is RESTART:
        allowed.add("engine_fault_request")
    return [
        f"{s.kind} {s.trace_id} life {s.life}: {s.error}"
        for s in sent
        if s.error is not None and s.error.get("code") not in allowed
    ]


def _innocents(sent: list[Sent]) -> list[str]:
    """Requests failed as a poison that were not the poison: the rules allow it (a request
    in the batches of two failures of the same type, at its first step both times), and the
    run reports it."""
    return [
        f"{s.kind} {s.trace_id} life {s.life}: {s.error}"
        for s in sent
        if s.kind is not RequestKind.POISON
        and (s.error or {}).get("code") == "engine_fault_request"
    ]


def _faults(lines: list[str], kills: Counter[str]) -> Counter[str]:
    """Faults by kind: the injector's (`fault.injected` lines) and the signals sent."""
    faults: Counter[str] = Counter(kills)
    for record in _events(lines, "fault.injected"):
        name = f"{record['where']}:{record['kind']}"
        faults[f"{name} (poison)" if name == POISON else name] += 1
    return faults


def _events(lines: list[str], event: str) -> list[dict[str, Any]]:
    marker = f'"{event}"'
    found = []
    for line in lines:
        if marker in line:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == event:
                    found.append(record)
    return found


async def _run(config: ChaosConfig) -> ChaosResult:
    started = time.monotonic()
    with OtlpReceiver("grpc") as receiver:
        chaos = Chaos(config, receiver)
        try:
            if config.mode is RESTART:
                await chaos.run_restart()
            else:
                await chaos.run_shutdown()
        finally:
            for life in chaos.lives:
                life.watch.kill_leftovers()
        await asyncio.sleep(2.0)  # the last span batches of the last life
        spans = request_spans(receiver.spans())
    lines = [line for life in chaos.lives for line in life.server.lines()]
    metrics: Counter[tuple[str, str]] = Counter()
    for life in chaos.lives:
        metrics.update(life.metrics_end - life.metrics_start)
    ledger = reconcile(chaos.sent, log_records(lines), spans, metrics)
    reference = await _reference(config, chaos.pool)
    leftovers = [
        f"{proc.pid} ({title(proc)})"
        for life in chaos.lives
        for proc in life.watch.seen.values()
        if is_alive(proc)
    ]
    restarting = _events(lines, "engine.restarting")
    return ChaosResult(
        config=config,
        sent=chaos.sent,
        num_not_sent=chaos.num_not_sent,
        faults=_faults(lines, chaos.kills),
        num_restarts=len(restarting),
        num_poison_verdicts=sum(r.get("poison_request_id") is not None for r in restarting),
        ledger=ledger,
        comparison=compare_outputs(chaos.sent, reference),
        unexpected=_unexpected(config, chaos.sent),
        innocents=_innocents(chaos.sent),
        leftovers=leftovers,
        resources=[sample for life in chaos.lives for sample in life.resources],
        exit_codes=[life.exit_code for life in chaos.lives],
        wall_s=round(time.monotonic() - started, 1),
    )


def run_chaos(config: ChaosConfig) -> ChaosResult:
    """One chaos run, reconciled (see the module's docstring)."""
    return asyncio.run(_run(config))
