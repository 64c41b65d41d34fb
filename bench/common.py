"""Shared pieces of the benchmarks: prompts, statistics, CPU contention, the server process
and its memory, and an OpenAI-client load generator (`run_concurrency`).

`ServerProcess` starts `python -m otel_engine.cli serve` with its output in a temporary log
file, remembers every descendant it has seen, and on `stop()` sends SIGTERM to the server
only, waits, and kills by pid whatever it started that is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

FIRST_ORDINARY_TOKEN_ID = 1000  # keeps random prompts clear of special and byte tokens


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` distinct prompts of `length` random token ids; the same for the same seed."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < num:
        prompt = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(length)]
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            prompts.append(prompt)
    return prompts


def quantile(values: list[float], q: float) -> float | None:
    """Linear-interpolated quantile; None for an empty list."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def _machine_busy_seconds() -> float:
    times = psutil.cpu_times()
    return float(
        times.user
        + times.nice
        + times.system
        + getattr(times, "irq", 0.0)
        + getattr(times, "softirq", 0.0)
    )


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


class CpuMeter:
    """CPU cores busy during one measurement: per named group of processes, and the rest of
    the machine (`other`, i.e. whatever else runs there: contention)."""

    def __init__(self, groups: dict[str, list[psutil.Process]]) -> None:
        self.groups = groups
        self.start = time.monotonic()
        self.busy = _machine_busy_seconds()
        self.used = {name: _cpu_seconds(procs) for name, procs in groups.items()}

    def stop(self) -> dict[str, float]:
        wall = max(time.monotonic() - self.start, 1e-6)
        cores = {
            name: (_cpu_seconds(procs) - self.used[name]) / wall
            for name, procs in self.groups.items()
        }
        busy = (_machine_busy_seconds() - self.busy) / wall
        return {
            **{k: round(v, 2) for k, v in cores.items()},
            "other": round(max(0.0, busy - sum(cores.values())), 2),
        }


def own_processes() -> list[psutil.Process]:
    """This process and its descendants (an in-process engine may still start workers)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _is_alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _role(proc: psutil.Process, server_pid: int) -> str:
    """A short label: the process title the engine set, or what its command line says."""
    if proc.pid == server_pid:
        return "api_server"
    try:
        name, cmdline = proc.name(), proc.cmdline()
    except psutil.Error:
        return "?"
    if name.startswith("otel-"):
        return name
    text = " ".join(cmdline)
    for marker in ("resource_tracker", "semaphore_tracker", "forkserver"):
        if marker in text:
            return marker
    return (cmdline[0] if cmdline else name)[:40]


@dataclass
class MemoryPeaks:
    """Peak RSS per process of a tree, sampled by `ServerProcess.sample_memory`."""

    peaks: dict[int, tuple[str, float]] = field(default_factory=dict)

    def as_rows(self) -> list[dict[str, Any]]:
        return [
            {"pid": pid, "role": role, "peak_rss_mb": round(mb, 1)}
            for pid, (role, mb) in sorted(self.peaks.items())
        ]

    @property
    def total_mb(self) -> float:
        return sum(mb for _, mb in self.peaks.values())


class ServerProcess:
    """The `otel-engine serve` subprocess of one benchmark run."""

    def __init__(self, args: list[str], port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="otel-bench-server-", suffix=".log", delete=False
        )
        command = [
            sys.executable,
            "-m",
            "otel_engine.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {}
        self._remember()

    def _remember(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        for proc in tree:
            self.seen.setdefault(proc.pid, proc)
        return tree

    def wait_ready(self, timeout: float) -> float:
        """Seconds from process start until `/health` answered 200; raises on failure."""
        deadline = self.started_at + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited with {self.proc.returncode} before "
                        f"ready; log tail:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + "/health").status_code == 200:
                        self._remember()
                        return time.monotonic() - self.started_at
                time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; log tail:\n{self.log_tail()}")

    def processes(self) -> list[psutil.Process]:
        """The server and its descendants, as seen now."""
        return self._remember()

    def sample_memory(
        self, stop: threading.Event, peaks: MemoryPeaks, interval: float = 0.5
    ) -> None:
        """Until `stop` is set, record the peak RSS of the server and its descendants."""
        while True:
            for proc in self._remember():
                try:
                    mb = proc.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                role, peak = peaks.peaks.get(proc.pid, (_role(proc, self.proc.pid), 0.0))
                peaks.peaks[proc.pid] = (role, max(peak, mb))
            if stop.wait(interval):
                return

    def stop(self, timeout: float = 60.0, keep_log: bool = False) -> dict[str, Any]:
        """SIGTERM the server, wait, then kill by pid anything it started still alive."""
        self._remember()
        result: dict[str, Any] = {"signal": "SIGTERM"}
        began = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            result["exit_code"] = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            result["exit_code"] = self.proc.wait()
            result["killed_server"] = True
        result["shutdown_seconds"] = round(time.monotonic() - began, 2)
        deadline = time.monotonic() + 10.0
        while any(_is_alive(p) for p in self.seen.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = [p for p in self.seen.values() if _is_alive(p)]
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        result["killed_leftovers"] = [f"{p.pid} ({_role(p, self.proc.pid)})" for p in leftovers]
        self.log.close()
        is_clean = result["exit_code"] == 0 and not leftovers and result["shutdown_seconds"] < 10
        if is_clean and not keep_log:
            os.unlink(self.log.name)
        else:
            result["server_log"] = self.log.name
        return result

    def log_tail(self, num_bytes: int = 3000) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as file:
            file.seek(max(0, os.path.getsize(self.log.name) - num_bytes))
            return file.read().decode(errors="replace")


async def stream_completion(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One streamed `/v1/completions` request: tokens, TTFT, latency and TPOT in seconds."""
    start = time.perf_counter()
    ttft = None
    num_chunks = 0
    usage_tokens = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            num_chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    tokens = usage_tokens if usage_tokens is not None else num_chunks
    ttft = latency if ttft is None else ttft
    tpot = (latency - ttft) / (tokens - 1) if tokens > 1 else None
    return {"tokens": tokens, "ttft": ttft, "latency": latency, "tpot": tpot}


async def run_concurrency(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """Send `prompts` from `concurrency` client tasks, each request after the previous one;
    output tokens/s, TTFT median and p90, TPOT median (ms), and failed requests."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[dict[str, Any]] = []
    errors: list[str] = []

    async def worker() -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                records.append(await stream_completion(client, model, prompt, max_tokens))
            except Exception as error:
                cause = error.__cause__
                errors.append(
                    f"{type(error).__name__}: {error}"
                    + (f" ({type(cause).__name__}: {cause})" if cause else "")
                )

    http_client = DefaultAsyncHttpxClient(trust_env=False)  # loopback: never via a proxy
    async with AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=600.0,
        http_client=http_client,
    ) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(int(r["tokens"]) for r in records)
    ttfts = [r["ttft"] for r in records]
    tpots = [r["tpot"] for r in records if r["tpot"] is not None]
    return {
        "concurrency": concurrency,
        "num_requests": len(records),
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall, 1),
        "ttft_median_ms": _ms(quantile(ttfts, 0.5)),
        "ttft_p90_ms": _ms(quantile(ttfts, 0.9)),
        "tpot_median_ms": _ms(quantile(tpots, 0.5)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)
