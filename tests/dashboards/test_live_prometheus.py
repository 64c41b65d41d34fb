"""Every dashboard query, run by a real Prometheus against real servers.

Debian's `prometheus` is started on 127.0.0.1 (scraping every second, exemplar storage on)
with two targets in job `otel-engine`: a healthy server under load from the openai client,
exporting traces to a real OTLP receiver, and a server with an injected worker fault. Every
PromQL expression of `dashboards/*.json` (Grafana variables substituted) must return data
under load; the ones that only have data after a crash (`AFTER_CRASH_ONLY`) must return data
after the injected crash, and the `OtelEngineCrashed` alert of deploy/compose/alerts.yml
(loaded by this Prometheus) fires. The crash server runs with `--final-scrape-wait`, so its
exit waits for the one scrape that records the failure, which the test proves by what
Prometheus stored.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.dashboards import generator
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.paths import REPO_ROOT
from tests.helpers.procs import ServerProcess, free_port, start_logged
from tests.helpers.tools import prometheus_tool

pytestmark = pytest.mark.slow  # starts servers or engine processes

ALERT_RULES = REPO_ROOT / "deploy" / "compose" / "alerts.yml"
SCRAPE_INTERVAL = "1s"
FAULT_STEP = 40
FINAL_SCRAPE_WAIT_S = 20.0
DATA_TIMEOUT_S = 120.0


gen = generator()


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel, raw expr) for every PromQL expression of every dashboard."""
    return [
        (name, panel, expr)
        for name, dashboard in sorted(gen.build_dashboards().items())
        for panel, expr in gen.prometheus_queries(dashboard)
    ]


class Prometheus:
    """Debian's prometheus on 127.0.0.1 with its own config and storage under `workdir`."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL}\n"
            f"  scrape_timeout: {SCRAPE_INTERVAL}\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL}\n"
            f"rule_files: [{str(ALERT_RULES)!r}]\n"
            "scrape_configs:\n"
            "  - job_name: otel-engine\n"
            "    metrics_path: /metrics\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        self.command = [
            prometheus_tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage",
            "--log.level=warn",
        ]
        self.log_path = workdir / "prometheus.log"
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Prometheus:
        self._popen = start_logged(self.command, self.log_path, cwd=self.workdir)
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=self.url, timeout=2, trust_env=False) as client:
            while time.monotonic() < deadline:
                assert self._popen.poll() is None, self.log_path.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if client.get("/-/ready").status_code == 200:
                        return self
                time.sleep(0.2)
        raise AssertionError(f"prometheus not ready:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        """SIGTERM to the prometheus this object started (by pid), SIGKILL if it lingers."""
        if self._popen is None or self._popen.poll() is not None:
            return
        self._popen.terminate()
        try:
            self._popen.wait(10)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.wait(5)

    def api(self, path: str, **params: str) -> Any:
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            body = client.get(f"/api/v1/{path}", params=params).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one element) `expr` evaluates to now."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"value": data["result"]}]
        return list(data["result"])


def wait_for_data(
    prometheus: Prometheus, queries: list[tuple[str, str, str]], timeout: float
) -> list[str]:
    """Poll until every query returns a non-empty result; return those that never did."""
    pending = list(queries)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = [q for q in pending if not prometheus.query(gen.substitute(q[2]))]
        if pending:
            time.sleep(1.0)
    return [f"{name} / {panel}: {expr}" for name, panel, expr in pending]


class Load:
    """Streaming and non-streaming completions from a few openai-client threads."""

    def __init__(self, base_url: str, num_threads: int = 3) -> None:
        import openai

        self.client = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60
        )
        self.stop = threading.Event()
        self.num_ok = 0
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_threads)
        ]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        self.client.close()

    def _run(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                if index % 2:
                    stream = self.client.completions.create(
                        model="tiny", prompt="the quick brown fox", max_tokens=24, stream=True
                    )
                    for _ in stream:
                        pass
                else:
                    self.client.completions.create(
                        model="tiny", prompt="hello there", max_tokens=12
                    )
                self.num_ok += 1
            except Exception as exc:  # the crash server fails them: that is the point
                self.errors.append(exc)
                time.sleep(0.05)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver("grpc") as received:
        yield received


@pytest.fixture(scope="module")
def crash_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def healthy_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def healthy_server(
    tiny_model_dir: str, receiver: OtlpReceiver, healthy_port: int
) -> Iterator[ServerProcess]:
    server = ServerProcess(
        ["--model", tiny_model_dir, "--served-model-name", "tiny"],
        env={**receiver.env(), "OTEL_BSP_SCHEDULE_DELAY": "200"},
        port=healthy_port,
    )
    try:
        server.start().wait_healthy()
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, healthy_port: int, crash_port: int
) -> Iterator[Prometheus]:
    """Started before the servers, so a missing prometheus skips without starting them."""
    targets = [f"127.0.0.1:{healthy_port}", f"127.0.0.1:{crash_port}"]
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), targets)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def loaded(prometheus: Prometheus, healthy_server: ServerProcess) -> Iterator[Load]:
    """Load on the healthy server for the whole module, plus one rejected request."""
    with httpx.Client(base_url=healthy_server.base_url, timeout=10, trust_env=False) as client:
        client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    with Load(healthy_server.base_url) as load:
        yield load
    assert not load.errors, load.errors[:3]


def test_there_are_queries_to_check() -> None:
    """The dashboards have panels, and some query is reserved for the crash phase."""
    queries = dashboard_queries()
    assert len(queries) >= 20
    assert gen.AFTER_CRASH_ONLY
    assert gen.AFTER_CRASH_ONLY <= {expr for _, _, expr in queries}


def test_every_query_returns_data_from_a_loaded_server(
    prometheus: Prometheus, loaded: Load
) -> None:
    """Each panel's PromQL (not the crash-only ones) has data within two minutes of load."""
    queries = [q for q in dashboard_queries() if q[2] not in gen.AFTER_CRASH_ONLY]
    missing = wait_for_data(prometheus, queries, DATA_TIMEOUT_S)

    assert not missing, "queries without data:\n" + "\n".join(missing)
    assert loaded.num_ok > 0


def test_latency_exemplars_are_traces_the_collector_received(
    prometheus: Prometheus, loaded: Load, receiver: OtlpReceiver
) -> None:
    """A latency panel's exemplar links to a trace that really was exported."""
    deadline = time.monotonic() + 60
    trace_ids: set[str] = set()
    while not trace_ids and time.monotonic() < deadline:
        end = time.time()
        data = prometheus.api(
            "query_exemplars",
            query="otel_engine_time_to_first_token_seconds_bucket",
            start=str(end - 600),
            end=str(end),
        )
        trace_ids = {
            exemplar["labels"]["trace_id"]
            for series in data
            for exemplar in series["exemplars"]
            if "trace_id" in exemplar["labels"]
        }
        if not trace_ids:
            time.sleep(1)

    assert trace_ids

    def exported(r: OtlpReceiver) -> bool:
        return trace_ids <= {span["trace_id"] for span in r.spans()}

    assert receiver.wait_for(exported, timeout=30), "exemplar trace ids were never exported"


def test_crash_queries_return_data_after_an_injected_crash(
    tiny_model_dir: str, prometheus: Prometheus, crash_port: int, loaded: Load
) -> None:
    """An injected worker fault: the crash-only queries get data, the failed requests are
    counted as engine_dead, the dead state was scraped, and the server exited 1 right after
    that scrape (well before --final-scrape-wait ran out)."""
    server = ServerProcess(
        [
            "--model",
            tiny_model_dir,
            "--served-model-name",
            "tiny",
            "--final-scrape-wait",
            str(FINAL_SCRAPE_WAIT_S),
        ],
        env={"OTEL_ENGINE_FAULT": f"worker:raise:step={FAULT_STEP}"},
        port=crash_port,
    )
    try:
        server.start().wait_healthy()
        instance = f'instance="127.0.0.1:{crash_port}"'
        _wait(lambda: prometheus.query(f"up{{{instance}}} == 1"), "crash server scraped")
        with Load(server.base_url) as load:
            _wait(lambda: load.errors, "a client error from the crash", timeout=60)
            failed_at = time.monotonic()
            code = server.wait(timeout=FINAL_SCRAPE_WAIT_S + 30)
            exited_after = time.monotonic() - failed_at
    finally:
        server.cleanup()

    assert code == 1, server.tail()
    assert exited_after < FINAL_SCRAPE_WAIT_S - 5, (
        f"exit waited {exited_after:.1f}s: {server.tail()}"
    )
    dead = f'max_over_time(otel_engine_engine_health_state{{state="dead",{instance}}}[5m]) == 1'
    # Range functions, because the exited target's series are stale at "now".
    errors = (
        f'max_over_time(otel_engine_request_errors_total{{error_type="engine_dead",{instance}}}[5m])'
        " > 0"
    )
    assert prometheus.query(dead), "the dead state was never scraped"
    assert prometheus.query(errors), "the requests the crash failed were never scraped"
    crash_only = [q for q in dashboard_queries() if q[2] in gen.AFTER_CRASH_ONLY]
    missing = wait_for_data(prometheus, crash_only, 30)
    assert not missing, "crash queries without data:\n" + "\n".join(missing)
    firing = f'ALERTS{{alertname="OtelEngineCrashed", alertstate="firing", {instance}}}'
    _wait(lambda: prometheus.query(firing), "the OtelEngineCrashed alert")


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
