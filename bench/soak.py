"""A soak: mixed traffic at a fixed concurrency for minutes, and whether any process grows.

    .venv/bin/python bench/soak.py [--model PATH] [--dtype bfloat16] [--duration 600]
        [--concurrency 32] [--sample-every 10] [--json out.json]

One server (the default model unless `--model`). `--concurrency` client tasks send, one
after another, a rotation of requests: streamed and whole completions and chats, a
JSON-schema response, a request aborted mid-stream, logprobs, and a bad request (400), for
`--duration` seconds, while `/health` is polled every 0.5 s. Every `--sample-every` seconds
the RSS of each of the server's processes is recorded. Printed: requests by outcome and the
server's own counters for them (they must add up), the worst `/health` latency, and per
process the RSS at the end of the first minute, at the end, and its trend over the run's
second half (least squares, MB per minute). Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psutil
from common import (
    ServerProcess,
    fmt,
    free_port,
    metric_value,
    print_table,
    served_model_name,
    server_parser,
    start_benchmark,
    write_json,
)

HEALTH_EVERY_S = 0.5
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=float, default=10.0)
    return parser.parse_args(argv)


def _kinds(model: str) -> list[tuple[str, str, dict[str, Any], bool]]:
    """(name, path, body, stream) of each kind of request in the rotation."""
    chat = [{"role": "user", "content": "Tell me about the sea."}]
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return [
        ("completion", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32}, False),
        ("completion_stream", "/v1/completions", {"prompt": "The sky", "max_tokens": 48}, True),
        ("chat", "/v1/chat/completions", {"messages": chat, "max_tokens": 32}, False),
        ("chat_stream", "/v1/chat/completions", {"messages": chat, "max_tokens": 48}, True),
        (
            "json_schema",
            "/v1/chat/completions",
            {"messages": chat, "max_tokens": 40, "response_format": schema},
            False,
        ),
        (
            "logprobs",
            "/v1/completions",
            {"prompt": "Hello", "max_tokens": 16, "logprobs": 5},
            False,
        ),
        (
            "aborted",
            "/v1/completions",
            {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True},
            True,
        ),
        ("bad_request", "/v1/completions", {"prompt": "x", "max_tokens": -1}, False),
    ]


async def _one(
    client: httpx.AsyncClient, model: str, kind: tuple[str, str, dict[str, Any], bool]
) -> str:
    name, path, body, stream = kind
    body = {"model": model, **body, "stream": stream}
    if not stream:
        response = await client.post(path, json=body)
        return f"{name} {response.status_code}"
    async with client.stream("POST", path, json=body) as response:
        num = 0
        async for line in response.aiter_lines():
            num += line.startswith("data: ")
            if name == "aborted" and num >= 8:
                return f"{name} closed"  # leaving the block closes the connection: an abort
        return f"{name} {response.status_code}"


async def _traffic(base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    health: list[float] = []
    stop_at = time.monotonic() + args.duration
    rotation = itertools.cycle(_kinds(model))

    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, trust_env=False) as client:

        async def worker() -> None:
            while time.monotonic() < stop_at:
                try:
                    outcomes[await _one(client, model, next(rotation))] += 1
                except httpx.HTTPError as error:
                    outcomes[f"client error {type(error).__name__}"] += 1

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=base_url, timeout=30, trust_env=False) as own:
                while time.monotonic() < stop_at:
                    started = time.perf_counter()
                    await own.get("/health")
                    health.append(time.perf_counter() - started)
                    await asyncio.sleep(HEALTH_EVERY_S)

        await asyncio.gather(probe(), *(worker() for _ in range(args.concurrency)))
    return {
        "outcomes": dict(sorted(outcomes.items())),
        "health_max_ms": round(1000 * max(health), 1),
    }


def _sample(
    server: ServerProcess,
    stop: threading.Event,
    every: float,
    samples: dict[str, list[tuple[float, float]]],
) -> None:
    started = time.monotonic()
    while not stop.wait(every):
        for proc in server.processes():
            try:
                role = "api_server" if proc.pid == server.pid else proc.name()
                rss = proc.memory_info().rss / 2**20
            except psutil.Error:
                continue
            samples.setdefault(f"{role} ({proc.pid})", []).append((time.monotonic() - started, rss))


def _trend_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of the second half of the samples, MB per minute."""
    half = points[len(points) // 2 :]
    if len(half) < 3:
        return None
    mean_t = sum(t for t, _ in half) / len(half)
    mean_m = sum(m for _, m in half) / len(half)
    num = sum((t - mean_t) * (m - mean_m) for t, m in half)
    den = sum((t - mean_t) ** 2 for t, _ in half)
    return 60 * num / den if den else None


def _server_counts(base_url: str) -> dict[str, float]:
    """The server's own count of finished and failed requests, by outcome."""
    counts = {
        f"success {reason}": metric_value(
            base_url, "otel_engine_request_success_total", finish_reason=reason
        )
        for reason in ("stop", "length", "abort")
    }
    for error in ("invalid_value", "aborted", "client_stalled", "engine_dead"):
        counts[f"error {error}"] = metric_value(
            base_url, "otel_engine_request_errors_total", error_type=error
        )
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    server = ServerProcess(flags, free_port())
    results: dict[str, Any] = {"duration_s": args.duration, "concurrency": args.concurrency}
    samples: dict[str, list[tuple[float, float]]] = {}
    try:
        results["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        stop = threading.Event()
        sampler = threading.Thread(
            target=_sample, args=(server, stop, args.sample_every, samples), daemon=True
        )
        sampler.start()
        results.update(asyncio.run(_traffic(server.base_url, model, args)))
        stop.set()
        sampler.join()
        time.sleep(2)
        results["server_counts"] = _server_counts(server.base_url)
    finally:
        results["shutdown"] = server.stop()
    results["rss"] = {
        name: {
            "first_minute_mb": round(next((m for t, m in points if t >= 60), points[-1][1]), 1),
            "end_mb": round(points[-1][1], 1),
            "peak_mb": round(max(m for _, m in points), 1),
            "second_half_trend_mb_per_min": (
                None if (slope := _trend_mb_per_min(points)) is None else round(slope, 2)
            ),
        }
        for name, points in samples.items()
    }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_benchmark(args.model)
    results = run(args)
    print(f"\n== soak: {args.duration:.0f} s at concurrency {args.concurrency}")
    print_table(["outcome", "requests"], [[k, str(v)] for k, v in results["outcomes"].items()])
    print_table(
        ["server counter", "value"], [[k, fmt(v, 0)] for k, v in results["server_counts"].items()]
    )
    print(f"/health worst: {results['health_max_ms']} ms")
    print_table(
        ["process", "RSS at 1 min MB", "end MB", "peak MB", "trend (2nd half) MB/min"],
        [
            [
                name,
                fmt(r["first_minute_mb"]),
                fmt(r["end_mb"]),
                fmt(r["peak_mb"]),
                fmt(r["second_half_trend_mb_per_min"], 2),
            ]
            for name, r in results["rss"].items()
        ],
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
