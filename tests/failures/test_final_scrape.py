"""`--final-scrape-wait`: after an engine failure the server exits only once a GET /metrics
has read the failure (or the wait ran out), so a slow Prometheus still records the crash."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.failures.conftest import ProcessWatch
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

WAIT_S = 30.0


def _values(text: str) -> dict[tuple[str, str], float]:
    """(sample name, error_type or state) -> value, for the two series a crash moves."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.labels.get("error_type") or sample.labels.get("state") or ""
            values[sample.name, key] = sample.value
    return values


def test_exit_waits_for_the_scrape_that_reads_the_crash(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """Nobody scrapes: the server outlives its usual ~2 s exit, answering 503; the first
    scrape shows the dead state and the failed request, and the server exits 1 right after."""
    server, watch = start_server("--final-scrape-wait", str(WAIT_S), fault="worker:raise:step=3")
    with httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as client:
        failed = client.post(
            "/v1/completions", json={"model": server_model(client), "prompt": "hi", "max_tokens": 8}
        )
        assert failed.status_code == 500, failed.text
        assert failed.json()["error"]["code"] == "engine_dead"
        time.sleep(4.0)
        assert server.returncode is None, "exited before the final scrape"
        assert client.get("/health").status_code == 503

        scraped_at = time.monotonic()
        values = _values(client.get("/metrics").text)
        code = server.wait(timeout=10)
        exited_after = time.monotonic() - scraped_at

    assert code == 1, server.tail()
    assert exited_after < 5.0  # vs. the 30 s it would wait without the scrape
    assert values["otel_engine_engine_health_state", "dead"] == 1
    assert values["otel_engine_request_errors_total", "engine_dead"] >= 1
    watch.assert_all_gone(5.0)


def server_model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def test_exit_comes_when_the_wait_runs_out_without_a_scrape(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """No scraper at all: the wait is a bound, not a hang; the server exits 1 once it passed."""
    wait_s = 3.0
    server, watch = start_server("--final-scrape-wait", str(wait_s), fault="worker:raise:step=3")
    with httpx.Client(base_url=server.base_url, timeout=30, trust_env=False) as client:
        failed = client.post(
            "/v1/completions", json={"model": server_model(client), "prompt": "hi", "max_tokens": 8}
        )
        failed_at = time.monotonic()
    assert failed.status_code == 500, failed.text

    code = server.wait(timeout=wait_s + 15)
    exited_after = time.monotonic() - failed_at

    assert code == 1, server.tail()
    assert wait_s - 0.5 < exited_after < wait_s + 8, exited_after
    assert any(r.get("event") == "server.final_scrape_wait" for r in server.json_lines())
    watch.assert_all_gone(5.0)


def test_a_scrape_counts_only_once_every_failed_request_is_counted() -> None:
    """A scrape served while requests are still failing (in flight) could miss some of them:
    it does not release the exit; the next one, with none in flight, does."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from otel_engine.entrypoints.network.guard import ServerState
    from otel_engine.entrypoints.openai.app import build_app

    engine = SimpleNamespace(
        add_step_listener=lambda listener: None,
        add_recovery_listener=lambda listener: None,
        config=SimpleNamespace(observability=SimpleNamespace(log_prompts=False)),
        max_model_len=512,
        is_dead=True,
        dead_error=None,
    )
    state = ServerState(engine=engine)  # type: ignore[arg-type]
    with TestClient(build_app(state)) as client:
        state.num_in_flight = 1
        assert client.get("/metrics").status_code == 200
        assert not state.is_dead_scraped
        state.num_in_flight = 0
        body = client.get("/metrics").text

    assert state.is_dead_scraped
    assert _values(body)["otel_engine_engine_health_state", "dead"] == 1
