"""Speed of failure: how fast every streaming client learns that the engine died.

    .venv/bin/python bench/failure_speed.py [--model PATH] [--concurrency 32,256]
        [--tensor-parallel-size 2] [--fault SPEC | --kill otel-worker-1] [--json out.json]

For each concurrency C: start `otel-engine serve` (the tiny test model written to a temporary
directory unless --model is given), open C streaming `/v1/completions` (`ignore_eos`, long
`max_tokens`), wait until every stream has its first token, then inject one fault: SIGKILL of
a process found by its title (default `otel-worker-1`), or `OTEL_ENGINE_FAULT=SPEC` set on the
server from the start (its `fault.injected` log line gives the fault time). Reported, from the
fault: the engine's detection (`worker.died` / `engine.failed` / `engine.dead` log lines), the
first and last client error, the server's exit, and the last child gone. Numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from common import ServerProcess, fmt, free_port, is_alive, print_table, quantile, tiny_model

PROMPT = "When a worker process dies, the engine core notices within a second."
DETECTION_EVENTS = (
    "worker.died",
    "engine_core.died",
    "engine.failed",
    "engine.dead",
    "server.engine_dead",
)


@dataclass
class Stream:
    """One streaming client: when its first token came and how it ended."""

    first_token_at: float | None = None
    ended_at: float | None = None
    outcome: str = "running"  # error_event, http_<status>, transport_error, done, timeout
    message: str = ""


@dataclass
class Flow:
    """Counts the streams that have their first token; set once all of them have."""

    total: int
    num_flowing: int = 0
    all_flowing: asyncio.Event = field(default_factory=asyncio.Event)

    def mark(self) -> None:
        self.num_flowing += 1
        if self.num_flowing == self.total:
            self.all_flowing.set()


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], stream: Stream, flow: Flow
) -> None:
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stream.outcome = f"http_{response.status_code}"
                stream.message = (await response.aread()).decode(errors="replace")[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    stream.outcome = "done"
                    return
                event = json.loads(data)
                if "error" in event:
                    stream.outcome, stream.message = "error_event", event["error"]["message"]
                    return
                if stream.first_token_at is None:
                    stream.first_token_at = time.time()
                    flow.mark()
    except httpx.HTTPError as error:
        stream.outcome, stream.message = "transport_error", type(error).__name__
    finally:
        stream.ended_at = time.time()


async def _crowd(
    base_url: str, num: int, max_tokens: int, kill_pid: int | None, wait_s: float
) -> tuple[list[Stream], float | None]:
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    streams = [Stream() for _ in range(num)]
    flow = Flow(num)
    limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
    async with httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(wait_s, connect=30),
        limits=limits,
        trust_env=False,
    ) as client:
        tasks = [asyncio.create_task(_stream(client, body, s, flow)) for s in streams]
        killed_at = None
        if kill_pid is not None:
            try:
                await asyncio.wait_for(flow.all_flowing.wait(), wait_s)
            except TimeoutError:
                print(
                    f"  only {flow.num_flowing}/{num} streams flowing; injecting anyway", flush=True
                )
            await asyncio.sleep(0.3)
            killed_at = time.time()
            os.kill(kill_pid, signal.SIGKILL)
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        for task in pending:
            task.cancel()
        for stream in streams:
            if stream.outcome == "running":
                stream.outcome = "timeout"
    return streams, killed_at


def _log_times(path: str) -> dict[str, float]:
    """time.time() of the first log line of each interesting event."""
    times: dict[str, float] = {}
    with open(path, errors="replace") as file:
        for line in file:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event = record.get("event") if isinstance(record, dict) else None
            if event in ("fault.injected", *DETECTION_EVENTS) and event not in times:
                stamp = record["timestamp"].replace("Z", "+00:00")
                times[event] = datetime.fromisoformat(stamp).timestamp()
    return times


def run_level(args: argparse.Namespace, model: str, num: int) -> dict[str, Any]:
    flags = [
        "--model",
        model,
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--max-num-seqs",
        str(num),
        "--max-num-batched-tokens",
        str(max(2048, num * 32)),
        "--log-level",
        "INFO",
    ]
    if args.fault:
        os.environ["OTEL_ENGINE_FAULT"] = args.fault
    try:
        server = ServerProcess(flags, free_port())
    finally:
        os.environ.pop("OTEL_ENGINE_FAULT", None)
    exit_box: dict[str, float] = {}
    try:
        startup = server.wait_ready(args.startup_timeout)
        kill_pid = None if args.fault else server.find(args.kill).pid
        threading.Thread(
            target=lambda: (server.proc.wait(), exit_box.setdefault("exited_at", time.time())),
            daemon=True,
        ).start()
        print(f"[C={num}] server ready in {startup:.1f} s; streaming", flush=True)
        streams, killed_at = asyncio.run(
            _crowd(server.base_url, num, args.max_tokens, kill_pid, args.client_timeout)
        )
        server.proc.wait(args.client_timeout)
        gone_at = _wait_gone(server)
        times = _log_times(server.log_path)
    finally:
        result = server.stop()
    fault_at = killed_at or times.get("fault.injected")
    return _summary(
        num,
        streams,
        fault_at=fault_at,
        times=times,
        exited_at=exit_box.get("exited_at"),
        gone_at=gone_at,
        stop=result,
    )


def _wait_gone(server: ServerProcess, timeout: float = 30.0) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in server.seen.values() if is_alive(p)]
        if not alive:
            return time.time()
        time.sleep(0.02)
    return None


def _summary(
    num: int,
    streams: list[Stream],
    *,
    fault_at: float | None,
    times: dict[str, float],
    exited_at: float | None,
    gone_at: float | None,
    stop: dict[str, Any],
) -> dict[str, Any]:
    def since(moment: float | None) -> float | None:
        return None if moment is None or fault_at is None else round(moment - fault_at, 3)

    errors = [s.ended_at for s in streams if s.outcome == "error_event" and s.ended_at]
    outcomes: dict[str, int] = {}
    for stream in streams:
        outcomes[stream.outcome] = outcomes.get(stream.outcome, 0) + 1
    return {
        "concurrency": num,
        "streams_with_tokens_before_fault": sum(
            1 for s in streams if s.first_token_at and fault_at and s.first_token_at < fault_at
        ),
        "outcomes": outcomes,
        "messages": sorted({s.message for s in streams if s.message})[:3],
        "detection_s": {event: since(times.get(event)) for event in DETECTION_EVENTS},
        "first_error_s": since(min(errors, default=None)),
        "median_error_s": since(quantile(errors, 0.5)),
        "last_error_s": since(max(errors, default=None)),
        "exit_s": since(exited_at),
        "all_gone_s": since(gone_at),
        "exit_code": stop.get("exit_code"),
        "killed_leftovers": stop.get("killed_leftovers"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf (default: the tiny test model)")
    parser.add_argument("--concurrency", default="32,256", help="comma-separated levels")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--kill", default="otel-worker-1", help="title of the process to SIGKILL")
    parser.add_argument("--fault", help="OTEL_ENGINE_FAULT spec instead of a SIGKILL")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--client-timeout", type=float, default=120)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = args.model or tiny_model()
    how = f"OTEL_ENGINE_FAULT={args.fault}" if args.fault else f"SIGKILL {args.kill}"
    print(
        f"fault: {how}; TP={args.tensor_parallel_size}; cpus={os.cpu_count()}; "
        f"load={os.getloadavg()[0]:.2f}",
        flush=True,
    )
    results = [run_level(args, model, int(n)) for n in args.concurrency.split(",")]
    _print(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def _print(results: list[dict[str, Any]]) -> None:
    headers = [
        "C",
        "flowing",
        "detected",
        "api_dead",
        "1st err",
        "med err",
        "last err",
        "exit",
        "all gone",
        "code",
        "outcomes",
    ]
    rows = []
    for r in results:
        detection = r["detection_s"]
        detected = (
            detection["worker.died"] or detection["engine.failed"] or detection["engine_core.died"]
        )
        rows.append(
            [
                str(r["concurrency"]),
                str(r["streams_with_tokens_before_fault"]),
                fmt(detected, 3),
                fmt(detection["engine.dead"], 3),
                fmt(r["first_error_s"], 3),
                fmt(r["median_error_s"], 3),
                fmt(r["last_error_s"], 3),
                fmt(r["exit_s"], 3),
                fmt(r["all_gone_s"], 3),
                str(r["exit_code"]),
                ",".join(f"{k}={v}" for k, v in r["outcomes"].items()),
            ]
        )
    print("\nseconds from the fault:")
    print_table(headers, rows)
    for r in results:
        print(f"C={r['concurrency']}: {r['messages']}")


if __name__ == "__main__":
    main()
