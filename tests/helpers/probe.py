"""A `/health` prober: how long the server's event loop keeps a health check waiting while
something else is going on."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import httpx


class HealthProbe:
    """GET /health every `interval_s` from a thread, over one keep-alive connection, until
    the `with` block ends; `max_latency_s` is the slowest answer seen."""

    def __init__(self, base_url: str, interval_s: float = 0.02) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    @property
    def max_latency_s(self) -> float:
        return max(self.latencies, default=0.0)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30, trust_env=False) as client:
            client.get("/health")  # connect outside the measurement
            while not self._stop.wait(self.interval_s):
                started = time.perf_counter()
                response = client.get("/health")
                self.latencies.append(time.perf_counter() - started)
                self.statuses.append(response.status_code)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
