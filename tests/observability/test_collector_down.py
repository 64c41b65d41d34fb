"""When the telemetry backend is down: a collector port nobody listens on, and one that
accepts connections and never answers. The server serves, counts what it could not export,
logs the first failure of each signal once instead of a warning per retry, and still exits
within seconds of SIGTERM."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.procs import ServerProcess, free_port
from tests.helpers.scrape import metric_value

pytestmark = pytest.mark.slow  # starts servers

EXIT_LIMIT_S = 3.0


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A port that accepts connections and never reads or answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        for connection in accepted:
            connection.close()
        server.close()


@pytest.fixture(params=["closed", "silent"])
def collector_port(request: pytest.FixtureRequest) -> Iterator[int]:
    if request.param == "closed":
        yield free_port()
    else:
        with black_hole() as port:
            yield port


def test_a_server_whose_collector_is_down_serves_counts_and_exits_in_time(
    tiny_model_dir: str, collector_port: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    args = ["--model", tiny_model_dir, "--num-kv-blocks", "64", "--log-format", "json"]
    args += ["--otlp-endpoint", f"http://127.0.0.1:{collector_port}", "--otlp-logs"]
    server = ServerProcess(
        args,
        env={
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",  # seconds: each export gives up after 1 s
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_METRIC_EXPORT_INTERVAL": "300",
        },
    ).start()
    try:
        server.wait_healthy(timeout=120)
        for _ in range(3):
            response = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"prompt": "hi", "max_tokens": 4},
                timeout=30,
                trust_env=False,
            )
            assert response.status_code == 200
        deadline = time.monotonic() + 30
        while (
            metric_value(
                server.base_url, "otel_engine_telemetry_export_failures_total", signal="traces"
            )
            < 1
        ):
            assert time.monotonic() < deadline, "no failed trace export counted"
            time.sleep(0.2)

        started = time.monotonic()
        server.terminate()
        assert server.wait(30) == 0
        exit_s = time.monotonic() - started
    finally:
        server.cleanup()

    print(f"exit {exit_s:.2f} s after SIGTERM with the collector down")
    assert exit_s <= EXIT_LIMIT_S, f"exit took {exit_s:.1f} s"
    lines = server.json_lines()
    failed = [
        (r.get("role"), r.get("signal"))
        for r in lines
        if r.get("event") == "telemetry.export_failed"
    ]
    assert ("api_server", "traces") in failed
    assert len(failed) == len(set(failed))  # once per signal per process
    retries = [r for r in lines if "retrying" in str(r.get("event"))]
    assert len(retries) <= 3 * 3  # at most one per exporter logger per process
