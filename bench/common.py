"""Shared pieces of the benchmarks: prompts, statistics, CPU contention, the server process
and its memory, and an OpenAI-client load generator (`run_concurrency`).

`ServerProcess` is the test suite's server process (tests/helpers/procs.py, the one home of
starting a server, free ports and clean teardown) with what a benchmark measures added: on
`stop()` it sends SIGTERM to the server only, waits, kills by pid whatever it started that is
still alive, and reports how the shutdown went.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.helpers
from tests.helpers.procs import ServerProcess as _TestServer
from tests.helpers.procs import free_port, is_alive
from tests.helpers.scrape import metric_value

__all__ = ["free_port", "is_alive", "metric_value"]  # re-exported for the benchmarks

FIRST_ORDINARY_TOKEN_ID = 1000  # keeps random prompts clear of special and byte tokens


def server_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line with the flags every server benchmark takes: `--model`,
    `--dtype`, `--startup-timeout`, `--json`."""
    parser = argparse.ArgumentParser(description=doc.split("\n", maxsplit=1)[0])
    parser.add_argument("--model", help="HF directory or .gguf file (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser


def start_benchmark(model: str | None) -> int:
    """Process set-up of a server benchmark: SIGTERM runs the `finally` that stops the
    server, nothing is downloaded; returns the model's vocabulary size."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from otel_engine.model.arch import load_model_arch
    from otel_engine.model.loader import prepare_model_dir

    return load_model_arch(prepare_model_dir(model)).vocab_size


def tiny_model(context: int = 512) -> str:
    """The tiny test model (random weights, a context of `context` tokens), written to a new
    temporary directory."""
    from tests.helpers.tiny_model import write_tiny_llama

    return write_tiny_llama(Path(tempfile.mkdtemp(prefix="otel-bench-tiny-")), context=context)


def write_json(path: str | None, results: Any) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=2)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` distinct prompts of `length` random token ids; the same for the same seed. Ids
    start past the special and byte tokens (at 1000, or a quarter into a tiny vocabulary)."""
    rng = random.Random(seed)
    first = min(FIRST_ORDINARY_TOKEN_ID, vocab_size // 4)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < num:
        prompt = [rng.randrange(first, vocab_size) for _ in range(length)]
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


class ServerProcess(_TestServer):
    """The test suite's `otel-engine serve` process (tests/helpers/procs.py: its own session,
    output in a log file, every descendant remembered, only those signalled, by pid), started
    at once, plus what a benchmark reads: seconds to ready, peak memory, a shutdown report."""

    def __init__(self, args: list[str], port: int, env: dict[str, str] | None = None) -> None:
        super().__init__(args, env=env, port=port)
        self.started_at = time.monotonic()
        self.start()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self._proc()

    @property
    def seen(self) -> dict[int, psutil.Process]:
        return self._seen

    def processes(self) -> list[psutil.Process]:
        """The server and its descendants, as seen now."""
        return [self._seen[self.pid], *self.descendants()]

    def find(self, title: str, timeout: float = 30.0) -> psutil.Process:
        """The living process under the server whose title is `title` (`otel-worker-1`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.processes():
                try:
                    if proc.cmdline() and proc.cmdline()[0].split()[0] == title:
                        return proc
                except psutil.Error:
                    continue
            time.sleep(0.05)
        raise RuntimeError(f"no process titled {title} under the server")

    def wait_ready(self, timeout: float) -> float:
        """Seconds from process start until `/health` answered 200; raises on failure."""
        self.wait_healthy(timeout - (time.monotonic() - self.started_at))
        return time.monotonic() - self.started_at

    def sample_memory(
        self, stop: threading.Event, peaks: MemoryPeaks, interval: float = 0.5
    ) -> None:
        """Until `stop` is set, record the peak RSS of the server and its descendants."""
        while True:
            for proc in self.processes():
                try:
                    mb = proc.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                role, peak = peaks.peaks.get(proc.pid, (_role(proc, self.pid), 0.0))
                peaks.peaks[proc.pid] = (role, max(peak, mb))
            if stop.wait(interval):
                return

    def stop(self, timeout: float = 60.0, keep_log: bool = False) -> dict[str, Any]:
        """SIGTERM the server, wait, then kill by pid anything it started still alive; the
        log is deleted after a clean stop unless `keep_log`."""
        self.descendants()
        result: dict[str, Any] = {"signal": "SIGTERM"}
        began = time.monotonic()
        if self.returncode is None:
            self.terminate()
        try:
            result["exit_code"] = self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            result["exit_code"] = self.wait()
            result["killed_server"] = True
        result["shutdown_seconds"] = round(time.monotonic() - began, 2)
        deadline = time.monotonic() + 10.0
        while any(is_alive(p) for p in self._seen.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftovers = [p for p in self._seen.values() if is_alive(p)]
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        result["killed_leftovers"] = [f"{p.pid} ({_role(p, self.pid)})" for p in leftovers]
        is_clean = result["exit_code"] == 0 and not leftovers and result["shutdown_seconds"] < 10
        if is_clean and not keep_log:
            self.log_path.unlink(missing_ok=True)
        else:
            result["server_log"] = str(self.log_path)
        return result

    def log_tail(self, num_lines: int = 40) -> str:
        return self.tail(num_lines)


MASK_METRIC = "otel_engine_step_grammar_mask_seconds_sum"


def metric_sum(base_url: str, name: str) -> float | None:
    """The value of the first sample of `name` in the server's /metrics (None: absent)."""
    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return None


def served_model_name(base_url: str) -> str:
    response = httpx.get(base_url + "/v1/models", timeout=10, trust_env=False)
    return str(response.json()["data"][0]["id"])


async def stream_completion(
    client: Any,
    model: str,
    prompt: list[int],
    max_tokens: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed `/v1/completions` request (greedy, `ignore_eos`, plus `options` in the
    body): tokens, TTFT, latency and TPOT in seconds."""
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
        extra_body={"ignore_eos": True, **(options or {})},
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


def add_request_count_args(parser: argparse.ArgumentParser) -> None:
    """How many requests a level of concurrency sends (`requests_at`)."""
    parser.add_argument(
        "--requests-per-stream",
        type=int,
        default=2,
        help="requests per level = this x concurrent streams (at least --min-requests)",
    )
    parser.add_argument("--min-requests", type=int, default=4)


def requests_at(args: argparse.Namespace, streams: int) -> int:
    """The requests to send at `streams` concurrent streams (`add_request_count_args`)."""
    return int(max(args.min_requests, args.requests_per_stream * streams))


async def run_concurrency(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Send `prompts` from `concurrency` client tasks, each request after the previous one
    (`options`: more body fields); output tokens/s, TTFT median and p90, TPOT median (ms),
    and failed requests."""
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
                records.append(await stream_completion(client, model, prompt, max_tokens, options))
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
