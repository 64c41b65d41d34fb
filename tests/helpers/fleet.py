"""Replicas of `otel-engine serve` behind vLLM's router (`vllm-router`, the Rust router of the
PyPI wheel), all on 127.0.0.1, for the fleet tests and `bench/fleet.py`.

`Fleet` starts the replicas (each a `ServerProcess` with its own log), waits until each is
healthy, then starts the router in front of them and waits until it routes. Only what it
started is ever signalled, by pid. `replica_death_drill` kills one replica's engine core under
load and measures what the clients and the router saw; `prefix_hit_rate` reads the replicas'
own prefix-cache counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from tests.failures.crowd import ClientResult, run_crowd
from tests.helpers.procs import ServerProcess, free_port, start_logged

ROUTER = "vllm-router"
# What the fleet docs recommend for otel-engine replicas (docs/operations.md, "Running a
# fleet"): a health check every second, one failed check takes a replica out, two good ones
# bring it back; retries and the circuit breaker as the router ships them.
ROUTER_HEALTH_ARGS = (
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "2",
    "--health-check-timeout-secs",
    "1",
)


def router_binary() -> str | None:
    """The `vllm-router` launcher installed beside this Python (the test extras install it)."""
    path = Path(sys.executable).with_name(ROUTER)
    return str(path) if path.exists() else None


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus endpoint, keyed by (name, sorted labels)."""
    with httpx.Client(timeout=10, trust_env=False) as client:
        text = client.get(url).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric_total(samples: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


class RouterProcess:
    """`vllm-router` in front of `worker_urls`, with its Prometheus endpoint on its own port."""

    def __init__(
        self,
        worker_urls: list[str],
        policy: str,
        args: tuple[str, ...] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError(f"{ROUTER} is not installed beside {sys.executable}")
        self.port, self.metrics_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.command = [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            policy,
            "--worker-urls",
            *worker_urls,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            *args,
        ]
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> RouterProcess:
        """Start it and wait until it answers on its port and its metrics port."""
        env = {**os.environ, "NO_COLOR": "1", "RUST_LOG_STYLE": "never"}
        self._popen = start_logged(self.command, self.log_path, env=env)
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self._popen.poll() is not None:
                    code = self._popen.returncode
                    raise AssertionError(f"{ROUTER} exited {code}:\n{self.tail()}")
                with contextlib.suppress(httpx.TransportError):
                    ready = client.get(f"{self.base_url}/health").status_code == 200
                    if ready and client.get(self.metrics_url).status_code == 200:
                        return self
                time.sleep(0.1)
        raise AssertionError(f"{ROUTER} not ready after {timeout}s:\n{self.tail()}")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.metrics_url)

    def tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` (this process only)."""
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.send_signal(signal.SIGTERM)
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(timeout)


class Fleet:
    """`num_replicas` servers of `model` behind one router with `policy`."""

    def __init__(
        self,
        model: str,
        *,
        num_replicas: int = 3,
        policy: str = "power_of_two",
        replica_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = ROUTER_HEALTH_ARGS,
        env: dict[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="otel-engine-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas = [
            ServerProcess(
                ["--model", model, *replica_args],
                env=env,
                log_path=self.log_dir / f"replica-{index}.log",
            )
            for index in range(num_replicas)
        ]
        self.policy = policy
        self.router_args = router_args
        self.router: RouterProcess | None = None

    def start(self) -> Fleet:
        for replica in self.replicas:
            replica.start()
        for replica in self.replicas:
            replica.wait_healthy()
        self.router = self.start_router(self.policy)
        return self

    def start_router(self, policy: str) -> RouterProcess:
        """Another router with `policy` in front of the same replicas (the caller stops it)."""
        return RouterProcess(
            [replica.base_url for replica in self.replicas],
            policy,
            self.router_args,
            log_path=self.log_dir / f"router-{policy}-{time.monotonic_ns()}.log",
        ).start()

    @property
    def model(self) -> str:
        """The served model name, as the first replica answers it."""
        with httpx.Client(base_url=self.replicas[0].base_url, timeout=10, trust_env=False) as c:
            return str(c.get("/v1/models").json()["data"][0]["id"])

    @property
    def base_url(self) -> str:
        assert self.router is not None, "fleet not started"
        return self.router.base_url

    def cleanup(self) -> None:
        if self.router is not None:
            self.router.stop()
        for replica in self.replicas:
            with contextlib.suppress(RuntimeError):  # never started
                if replica.returncode is None:
                    replica.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        replica.wait(30)
            replica.cleanup()

    def __enter__(self) -> Fleet:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.cleanup()


def prefix_hit_rate(replicas: list[ServerProcess]) -> tuple[float, float]:
    """(hits, queries) of prompt tokens, summed over the replicas' own counters."""
    hits = queries = 0.0
    for replica in replicas:
        samples = scrape(f"{replica.base_url}/metrics")
        hits += metric_total(samples, "otel_engine_prefix_cache_hits_total")
        queries += metric_total(samples, "otel_engine_prefix_cache_queries_total")
    return hits, queries


@dataclass
class ProbeResult:
    """One request sent through the router after the kill."""

    sent_at: float
    ok: bool
    status: int | None


@dataclass
class DeathDrill:
    """What a replica's death under load looked like from the clients and the router."""

    victim: int
    in_flight_on_victim: int  # the victim's own GET /get_load just before the kill
    killed_at: float
    results: list[ClientResult]
    exit_code: int | None
    victim_exited_at: float | None
    probes: list[ProbeResult] = field(default_factory=list)
    # router metric samples over time: (time, victim's processed-requests count, its health)
    routed: list[tuple[float, float, float]] = field(default_factory=list)

    @property
    def failed(self) -> list[ClientResult]:
        return [r for r in self.results if not r.completed]

    @property
    def completed(self) -> list[ClientResult]:
        return [r for r in self.results if r.completed]

    @property
    def last_failure_s(self) -> float | None:
        """Kill to the last failed client's error."""
        ends = [r.ended_at for r in self.failed if r.ended_at is not None]
        return max(ends) - self.killed_at if ends else None

    @property
    def last_routed_to_victim_s(self) -> float:
        """Kill to the last sample where the router had counted one more request for the
        victim (0: none was sent to it after the kill)."""
        last = 0.0
        for (_, before, _), (at, count, _) in zip(self.routed, self.routed[1:], strict=False):
            if count > before:
                last = at - self.killed_at
        return last

    @property
    def unhealthy_after_s(self) -> float | None:
        """Kill to the first sample where the router marked the victim unhealthy."""
        for at, _, health in self.routed:
            if health == 0:
                return at - self.killed_at
        return None


def _probe(base_url: str, model: str, stop: threading.Event, out: list[ProbeResult]) -> None:
    """New requests through the router, one after another, until `stop`."""
    body = {"model": model, "prompt": "probe", "max_tokens": 2}
    with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as client:
        while not stop.is_set():
            sent_at = time.time()
            try:
                response = client.post("/v1/completions", json=body)
                out.append(ProbeResult(sent_at, response.status_code == 200, response.status_code))
            except httpx.HTTPError:
                out.append(ProbeResult(sent_at, False, None))
            stop.wait(0.05)


def _watch_router(
    fleet: Fleet, victim_url: str, stop: threading.Event, out: list[tuple[float, float, float]]
) -> None:
    assert fleet.router is not None
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            samples = fleet.router.metrics()
            count = metric_total(samples, "vllm_router_processed_requests_total", worker=victim_url)
            health = metric_total(samples, "vllm_router_worker_health", worker=victim_url)
            out.append((time.time(), count, health))
        stop.wait(0.1)


def engine_core_of(replica: ServerProcess) -> psutil.Process:
    """The replica's engine core process (title `otel-engine-core`)."""
    from tests.failures.conftest import title

    for proc in replica.descendants():
        with contextlib.suppress(psutil.Error):
            if title(proc) == "otel-engine-core":
                return proc
    raise AssertionError(f"no otel-engine-core under {replica.pid}")


def replica_death_drill(
    fleet: Fleet,
    *,
    victim: int = 0,
    num_streams: int = 48,
    max_tokens: int = 400,
    watch_s: float = 12.0,
) -> DeathDrill:
    """`num_streams` streams through the router; once every one has its first token, SIGKILL
    the engine core of replica `victim`; keep sending new requests for `watch_s` seconds
    while sampling the router's view of the victim."""
    replica = fleet.replicas[victim]
    core = engine_core_of(replica)
    model = fleet.model
    stop = threading.Event()
    probes: list[ProbeResult] = []
    routed: list[tuple[float, float, float]] = []
    state: dict[str, Any] = {}

    def wait_exit() -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            state["exit_code"] = replica.wait(60)
            state["exited_at"] = time.time()

    def kill() -> None:
        with httpx.Client(base_url=replica.base_url, timeout=10, trust_env=False) as client:
            state["in_flight"] = client.get("/get_load").json()["load"]
        state["killed_at"] = time.time()
        os.kill(core.pid, signal.SIGKILL)
        for target, args in (
            (_probe, (fleet.base_url, model, stop, probes)),
            (_watch_router, (fleet, replica.base_url, stop, routed)),
            (wait_exit, ()),
        ):
            threading.Thread(target=target, args=args, daemon=True).start()

    results = asyncio.run(
        run_crowd(
            fleet.base_url, num_streams, max_tokens=max_tokens, on_flowing=kill, all_streams=True
        )
    )
    remaining = state["killed_at"] + watch_s - time.time()
    if remaining > 0:
        time.sleep(remaining)
    stop.set()
    time.sleep(0.2)
    return DeathDrill(
        victim=victim,
        in_flight_on_victim=state["in_flight"],
        killed_at=state["killed_at"],
        results=results,
        exit_code=state.get("exit_code"),
        victim_exited_at=state.get("exited_at"),
        probes=probes,
        routed=routed,
    )


def _words(rng: random.Random, num: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(num)
    )


def shared_prefix_chats(
    model: str, *, num_groups: int = 6, per_group: int = 6, seed: int = 0
) -> list[dict[str, Any]]:
    """Chat bodies in which each of `num_groups` agents has its own long system prompt shared by
    its `per_group` requests, in a shuffled order (so that a router that ignores prefixes
    spreads each agent over every replica). Another `seed` gives prompts no other seed shares."""
    rng = random.Random(seed)
    systems = [f"You are agent {seed}-{g}. " + _words(rng, 60) for g in range(num_groups)]
    bodies = [
        {
            "model": model,
            "max_tokens": 4,
            "messages": [
                {"role": "system", "content": systems[g]},
                {"role": "user", "content": f"question {u}: " + _words(rng, 5)},
            ],
        }
        for g in range(num_groups)
        for u in range(per_group)
    ]
    rng.shuffle(bodies)
    return bodies


def routed_hit_rate(fleet: Fleet, policy: str, bodies: list[dict[str, Any]]) -> float:
    """Send `bodies` one after another through a new router with `policy`; return the prefix
    cache hit rate those requests had on the replicas (their own counters, before and after)."""
    hits_before, queries_before = prefix_hit_rate(fleet.replicas)
    router = fleet.start_router(policy)
    try:
        with httpx.Client(base_url=router.base_url, timeout=60, trust_env=False) as client:
            for body in bodies:
                response = client.post("/v1/chat/completions", json=body)
                assert 200 == response.status_code, response.text
    finally:
        router.stop()
    hits, queries = prefix_hit_rate(fleet.replicas)
    return (hits - hits_before) / (queries - queries_before)
