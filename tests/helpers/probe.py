"""A `/health` prober: how long the server's event loop keeps a health check waiting while
something else is going on.

The probe runs in its own process, so that what the test process does meanwhile (parsing
metrics, other threads) never delays the probe itself and shows up as a slow server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import TracebackType

_PROBE = """
import json, sys, threading, time
import httpx

base_url, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies, statuses = [], []
with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as client:
    client.get("/health")  # connect outside the measurement
    print("ready", flush=True)
    while not stop.wait(interval):
        started = time.perf_counter()
        response = client.get("/health")
        latencies.append(time.perf_counter() - started)
        statuses.append(response.status_code)
print(json.dumps({"latencies": latencies, "statuses": statuses}), flush=True)
"""


class HealthProbe:
    """GET /health every `interval_s` from another process, over one keep-alive connection,
    until the `with` block ends; `max_latency_s` is the slowest answer seen."""

    def __init__(self, base_url: str, interval_s: float = 0.02) -> None:
        self.base_url = base_url
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._proc: subprocess.Popen[str] | None = None

    @property
    def max_latency_s(self) -> float:
        return max(self.latencies, default=0.0)

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, self.base_url, str(self.interval_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        assert "ready" == self._proc.stdout.readline().strip()
        time.sleep(0.05)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._proc is not None
        try:
            out, _ = self._proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            raise
        result = json.loads(out.strip().splitlines()[-1])
        self.latencies, self.statuses = result["latencies"], result["statuses"]
