"""`/health` under failure, on an in-process server that stays up after the engine died.

The engine core is frozen with SIGSTOP while four requests are in flight (nothing inside it
can run, not even its step watchdog): within the watchdog window `/health` must answer 503.
The requests ask for 4000 tokens of a long-context tiny model (several seconds of decoding),
so a test process starved on two cores still freezes the core before any request finishes.
The core is then SIGKILLed: every client gets its error and `/health` answers 503
`engine_dead`. The server is `make_server(..., exit_on_engine_death=False)`, so `/health` can
be read after the death (the CLI server exits instead).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from tests.entrypoints.conftest import ServerLoop
from tests.failures.conftest import ProcessWatch
from tests.failures.crowd import ClientResult, assert_all_failed, run_crowd

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
