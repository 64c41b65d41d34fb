"""Grammar abuse over HTTP: what a batch of costly schemas does to everyone else.

    .venv/bin/python bench/grammar_abuse.py [--model PATH] [--dtype bfloat16]
        [--requests 32] [--max-tokens 200] [--pattern '^a{100000}$'] [--distinct]
        [--json out.json]

One server. First, ordinary 4-token requests alone (their latency) and the engine core's
RSS. Then `--requests` concurrent `/v1/completions` requests whose `response_format` is a
string schema with `--pattern` (`--distinct`: each its own variant, `^a{100000}$`,
`^a{100001}$`, ...), `--max-tokens` each, while a probe sends an ordinary 4-token request
every 0.25 s. Printed: the abusive requests' status codes and wall time, the probes' latency
(median, p90, worst), the engine core's RSS before, at its peak and 5 s after the batch, and
the server's mask-time counter when it has one. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import psutil
from common import (
    MASK_METRIC,
    MemoryPeaks,
    ServerProcess,
    fmt,
    free_port,
    metric_sum,
    print_table,
    quantile,
    served_model_name,
    server_parser,
    start_benchmark,
    write_json,
)

PROBE_INTERVAL_S = 0.25
SETTLE_S = 5.0  # after the batch, before the last RSS reading


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--pattern", default="^a{100000}$")
    parser.add_argument("--distinct", action="store_true", help="a different variant each")
    parser.add_argument("--baseline-probes", type=int, default=10)
    return parser.parse_args(argv)


def _patterns(args: argparse.Namespace) -> list[str]:
    if not args.distinct:
        return [args.pattern] * args.requests
    match = re.search(r"\{(\d+)\}", args.pattern)
    if match is None:
        raise SystemExit("--distinct needs a pattern with a {N} repeat")
    count = int(match.group(1))
    return [
        args.pattern[: match.start(1)] + str(count + i) + args.pattern[match.end(1) :]
        for i in range(args.requests)
    ]


def _core_rss_mb(server: ServerProcess) -> float | None:
    for proc in server.processes():
        try:
            if proc.name() == "otel-engine-core":
                return round(proc.memory_info().rss / 2**20, 1)
        except psutil.Error:
            continue
    return None


async def _probe(client: httpx.AsyncClient, model: str) -> tuple[float, int]:
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    started = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    return time.perf_counter() - started, response.status_code


async def _abuse(
    client: httpx.AsyncClient, model: str, pattern: str, max_tokens: int
) -> tuple[int, str]:
    schema = {"type": "string", "pattern": pattern}
    body = {
        "model": model,
        "prompt": "Write the string:",
        "max_tokens": max_tokens,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    response = await client.post("/v1/completions", json=body)
    code = ""
    if response.status_code != 200:
        error = response.json().get("error", {})
        code = f"{error.get('code')}/{error.get('param')}"
    return response.status_code, code


async def _measure(base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url, timeout=900.0, trust_env=False) as client:
        alone = [(await _probe(client, model))[0] for _ in range(args.baseline_probes)]
        probes: list[float] = []
        done = asyncio.Event()

        async def probe_loop() -> None:
            while not done.is_set():
                probes.append((await _probe(client, model))[0])
                await asyncio.sleep(PROBE_INTERVAL_S)

        prober = asyncio.create_task(probe_loop())
        started = time.perf_counter()
        answers = await asyncio.gather(
            *(_abuse(client, model, p, args.max_tokens) for p in _patterns(args))
        )
        batch_s = time.perf_counter() - started
        done.set()
        await prober
    statuses = Counter(f"{status} {code}".strip() for status, code in answers)
    return {
        "alone_median_ms": _ms(quantile(alone, 0.5)),
        "batch_s": round(batch_s, 2),
        "statuses": dict(statuses),
        "num_probes": len(probes),
        "probe_median_ms": _ms(quantile(probes, 0.5)),
        "probe_p90_ms": _ms(quantile(probes, 0.9)),
        "probe_max_ms": _ms(max(probes) if probes else None),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    server = ServerProcess(flags, free_port())
    results: dict[str, Any] = {"pattern": args.pattern, "distinct": args.distinct}
    try:
        results["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        results["core_rss_before_mb"] = _core_rss_mb(server)
        stop, peaks = threading.Event(), MemoryPeaks()
        sampler = threading.Thread(target=server.sample_memory, args=(stop, peaks), daemon=True)
        sampler.start()
        results.update(asyncio.run(_measure(server.base_url, model, args)))
        stop.set()
        sampler.join()
        core = [mb for role, mb in peaks.peaks.values() if role == "otel-engine-core"]
        results["core_rss_peak_mb"] = round(max(core), 1) if core else None
        time.sleep(SETTLE_S)
        results["core_rss_after_mb"] = _core_rss_mb(server)
        results["mask_seconds_total"] = metric_sum(server.base_url, MASK_METRIC)
    finally:
        results["shutdown"] = server.stop()
    return results


def print_summary(results: dict[str, Any], args: argparse.Namespace) -> None:
    kind = "distinct variants of" if args.distinct else "x"
    print(f"\n== {args.requests} {kind} {args.pattern!r}, max_tokens {args.max_tokens}")
    print(f"abusive requests: {results['statuses']} in {results['batch_s']} s")
    print_table(
        ["4-token request", "median ms", "p90 ms", "max ms", "probes"],
        [
            ["alone", fmt(results["alone_median_ms"]), "-", "-", str(args.baseline_probes)],
            [
                "during the batch",
                fmt(results["probe_median_ms"]),
                fmt(results["probe_p90_ms"]),
                fmt(results["probe_max_ms"]),
                str(results["num_probes"]),
            ],
        ],
    )
    print_table(
        ["engine core RSS", "MB"],
        [
            ["before", fmt(results["core_rss_before_mb"])],
            ["peak", fmt(results["core_rss_peak_mb"])],
            [f"{SETTLE_S:.0f} s after", fmt(results["core_rss_after_mb"])],
        ],
    )
    print(f"grammar mask seconds (metric): {fmt(results['mask_seconds_total'], 2)}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_benchmark(args.model)
    results = run(args)
    print_summary(results, args)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
