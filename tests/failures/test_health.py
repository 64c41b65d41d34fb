"""`/health` under failure, on an in-process server that stays up after the engine died.

The engine core is frozen with SIGSTOP while four requests are in flight (nothing inside it
can run, not even its step watchdog): within the watchdog window `/health` must answer 503.
The requests ask for 4000 tokens of a long-context tiny model (several seconds of decoding),
so a test process starved on two cores still freezes the core before any request finishes.
The core is then SIGKILLed: every client gets its error and `/health` answers 503
`engine_dead`. The server is `make_server(..., exit_on_engine_death=False)`, so `/health` can
be read after the death (the CLI server exits instead).

Liveness without work: an idle engine core frozen with SIGSTOP sends no heartbeat, and
`/health` of a real `otel-engine serve` answers 503 within the heartbeat bound, then 200 again
after SIGCONT; a step that keeps the core's main thread busy longer than that bound (an
injected hang, shorter than --step-timeout) is no false alarm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from otel_engine.timing import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
from tests.entrypoints.conftest import ServerLoop
from tests.failures.conftest import ProcessWatch, log_time
from tests.failures.crowd import ClientResult, assert_all_failed, run_crowd
from tests.helpers.paths import REPO_ROOT
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

STEP_TIMEOUT_S = 2.0
CONTEXT = 4096
MAX_TOKENS = 4000
HEALTH_SLACK_S = 3.0


@dataclass
class Outage:
    """What `/health` and the clients saw while the engine core was frozen, then killed."""

    frozen_at: float = 0.0
    stall_503_after: float | None = None  # seconds from SIGSTOP to the first 503
    killed_at: float = 0.0
    dead_503_after: float | None = None  # seconds from SIGKILL to the first engine_dead 503
    dead_health: httpx.Response | None = None
    results: list[ClientResult] = field(default_factory=list)


def _first_503(
    base_url: str, since: float, timeout: float, code: str | None = None
) -> tuple[float | None, httpx.Response | None]:
    """Poll /health every 20 ms; seconds from `since` (time.time()) to the first 503."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=1.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                response = client.get("/health")
            except httpx.TimeoutException:
                continue
            if response.status_code == 503 and (
                code is None or response.json()["error"]["code"] == code
            ):
                return time.time() - since, response
            time.sleep(0.02)
    return None, None


@pytest.fixture(scope="module")
def outage(long_context_model_dir: str) -> Iterator[Outage]:
    baseline = {p.pid for p in ProcessWatch(os.getpid()).sample()}
    watch = ProcessWatch(os.getpid(), ignore=baseline)
    loop = ServerLoop()
    engine = AsyncLLM(
        long_context_model_dir, num_kv_blocks=4 * CONTEXT // 16, step_timeout=STEP_TIMEOUT_S
    )
    outage = Outage()
    try:
        core = watch.find("otel-engine-core")
        base_url = loop.start(make_server(engine, drain_timeout=5, exit_on_engine_death=False))
        frozen = threading.Event()

        def freeze() -> None:
            outage.frozen_at = time.time()
            os.kill(core.pid, signal.SIGSTOP)
            frozen.set()

        crowd = threading.Thread(
            target=lambda: outage.results.extend(
                asyncio.run(run_crowd(base_url, 4, max_tokens=MAX_TOKENS, on_flowing=freeze))
            ),
            name="crowd",
        )
        crowd.start()
        assert frozen.wait(30), "the streams never started"
        outage.stall_503_after, _ = _first_503(
            base_url, outage.frozen_at, STEP_TIMEOUT_S + HEALTH_SLACK_S
        )
        outage.killed_at = time.time()
        os.kill(core.pid, signal.SIGKILL)
        outage.dead_503_after, outage.dead_health = _first_503(
            base_url, outage.killed_at, 10, code="engine_dead"
        )
        crowd.join(40)
        print(
            f"frozen core: 503 after {outage.stall_503_after} s; "
            f"killed core: engine_dead 503 after {outage.dead_503_after} s"
        )
        yield outage
    finally:
        watch.kill_leftovers()
        loop.close()
        engine.shutdown()


def test_health_is_503_while_the_engine_core_makes_no_progress(outage: Outage) -> None:
    """A frozen engine core with work pending: /health answers 503 within the watchdog
    window (--step-timeout) plus slack."""
    assert outage.stall_503_after is not None, "/health stayed 200 on a frozen engine"
    assert outage.stall_503_after < STEP_TIMEOUT_S + HEALTH_SLACK_S


def test_health_is_503_engine_dead_after_the_core_died(outage: Outage) -> None:
    """Once the engine core is SIGKILLed, /health answers 503 engine_dead within 5 s."""
    assert outage.dead_503_after is not None
    assert outage.dead_503_after < 5.0
    assert outage.dead_health is not None
    assert "EngineCoreDied" in outage.dead_health.json()["error"]["message"]


def test_clients_of_the_killed_core_get_errors(outage: Outage) -> None:
    """Every in-flight client (streaming or not) got an error naming EngineCoreDied."""
    assert 4 == len(outage.results)
    assert_all_failed(outage.results, "EngineCoreDied")


def _health_codes(base_url: str, seconds: float) -> list[tuple[float, int]]:
    """(time.time(), status) of a GET /health every 100 ms for `seconds`."""
    probes = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base_url, timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                probes.append((time.time(), client.get("/health").status_code))
            except httpx.TimeoutException:
                probes.append((time.time(), 0))
            time.sleep(0.1)
    return probes


def test_health_fails_while_an_idle_engine_core_is_frozen_and_recovers(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """SIGSTOP an idle engine core: /health answers 503 `engine_stalled` once no heartbeat
    came for HEARTBEAT_TIMEOUT_S (not before, and within slack after), and 200 again soon
    after SIGCONT; the server then serves a completion."""
    server, watch = start_server("--step-timeout", "60")
    core = watch.find("otel-engine-core")
    frozen_at = time.time()
    os.kill(core.pid, signal.SIGSTOP)
    try:
        after, response = _first_503(server.base_url, frozen_at, HEARTBEAT_TIMEOUT_S + 10.0)
    finally:
        os.kill(core.pid, signal.SIGCONT)
    thawed_at = time.time()
    probes = _health_codes(server.base_url, 5.0)
    print(f"idle frozen core: /health 503 after {after} s")

    assert after is not None, "/health stayed 200 on a frozen engine core"
    assert HEARTBEAT_TIMEOUT_S - HEARTBEAT_INTERVAL_S - 0.5 < after < HEARTBEAT_TIMEOUT_S + 10.0
    assert response is not None
    assert "engine_stalled" == response.json()["error"]["code"]
    recovered = [at - thawed_at for at, status in probes if status == 200]
    assert recovered, probes
    assert recovered[0] < 3.0, probes
    with httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as client:
        body = {"prompt": "hello", "max_tokens": 4}
        assert 200 == client.post("/v1/completions", json=body).status_code


def test_a_step_longer_than_the_heartbeat_bound_is_no_false_alarm(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """The model's step blocks the core's main thread (injected hang, TP=1) for twice the
    heartbeat bound, below --step-timeout: the step watchdog's heartbeats go on and every
    /health probe answers 200."""
    server, _ = start_server("--step-timeout", "30", fault="worker:hang")

    def request() -> None:
        with (
            httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client,
            contextlib.suppress(httpx.HTTPError),
        ):
            client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})

    threading.Thread(target=request, daemon=True).start()
    deadline = time.monotonic() + 30
    while (hung_at := log_time(server, "fault.injected")) is None:
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.1)
    probes = _health_codes(server.base_url, 2 * HEARTBEAT_TIMEOUT_S)

    assert probes[-1][0] - hung_at > 2 * HEARTBEAT_TIMEOUT_S - 1.0
    assert {200} == {status for _, status in probes}, probes


def test_operations_doc_states_the_heartbeat_bounds() -> None:
    """docs/operations.md gives the heartbeat's interval and the silence that fails /health
    as timing.py has them."""
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert f"for {HEARTBEAT_TIMEOUT_S:g} s, not even the heartbeat" in text
    assert f"sends every {HEARTBEAT_INTERVAL_S:g} s" in text
