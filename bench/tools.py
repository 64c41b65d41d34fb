"""What tools cost: chat requests with and without them, at one concurrency, one server.

    .venv/bin/python bench/tools.py [--model PATH] [--dtype bfloat16] [--concurrency 8]
        [--requests 32] [--max-tokens 64] [--json out.json]

One server; three rounds of `--requests` chat completions at `--concurrency`, one after the
other: without tools (the baseline), with two function tools and `tool_choice: auto`, and
with `tool_choice: required` (the call forced by a grammar built from the tools' schemas;
on a model without a tool format, such as the default, `auto` is under a grammar too: text
or a call). Printed per round: requests per second, generated tokens per second, latency
median and p90, time to the first streamed chunk median, the calls returned, and the
server's grammar-mask seconds over the round. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import httpx
from common import (
    MASK_METRIC,
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

QUESTIONS = [
    "What will the weather be in Paris tomorrow?",
    "What time is it in Oslo?",
    "Tell me about the weather in Lima this week.",
    "Is it raining in Tokyo?",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The weather forecast of a city for a number of days",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
            },
        },
    },
]
ROUNDS = {"no tools": None, "tools, auto": "auto", "tools, required": "required"}


async def _one(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[float, float | None, int, int]:
    """(latency, seconds to the first chunk, generated tokens, calls) of one streamed chat."""
    started = time.perf_counter()
    first: float | None = None
    tokens = calls = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - started
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                calls += sum(1 for c in choice["delta"].get("tool_calls") or () if c.get("id"))
    return time.perf_counter() - started, first, tokens, calls


async def _round(base_url: str, model: str, choice: str | None, args: Any) -> dict[str, Any]:
    semaphore = asyncio.Semaphore(args.concurrency)

    async def run(index: int) -> tuple[float, float | None, int, int]:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if choice is not None:
            body |= {"tools": TOOLS, "tool_choice": choice}
        async with semaphore:
            return await _one(client, body)

    masks = metric_sum(base_url, MASK_METRIC) or 0.0
    async with httpx.AsyncClient(base_url=base_url, timeout=900.0, trust_env=False) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(args.requests)))
        wall = time.perf_counter() - started
    latencies = [r[0] for r in results]
    firsts = [r[1] for r in results if r[1] is not None]
    return {
        "requests_per_s": round(len(results) / wall, 2),
        "tokens_per_s": round(sum(r[2] for r in results) / wall, 1),
        "latency_p50_ms": round(1000 * (quantile(latencies, 0.5) or 0), 1),
        "latency_p90_ms": round(1000 * (quantile(latencies, 0.9) or 0), 1),
        "first_chunk_p50_ms": round(1000 * (quantile(firsts, 0.5) or 0), 1),
        "calls": sum(r[3] for r in results),
        "mask_s": round((metric_sum(base_url, MASK_METRIC) or 0.0) - masks, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = server_parser(__doc__ or "")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    start_benchmark(args.model)
    port = free_port()
    command = ["--dtype", args.dtype, "--max-num-seqs", str(args.concurrency)]
    if args.model:
        command += ["--model", args.model]
    server = ServerProcess(command, port)
    results: dict[str, Any] = {}
    try:
        server.wait_ready(args.startup_timeout)
        base_url = f"http://127.0.0.1:{port}"
        model = served_model_name(base_url)
        asyncio.run(_round(base_url, model, None, args))  # warm-up
        for name, choice in ROUNDS.items():
            results[name] = asyncio.run(_round(base_url, model, choice, args))
    finally:
        results["server"] = server.stop()
    headers = ["round", "req/s", "tok/s", "latency p50 ms", "p90 ms", "first chunk p50 ms"]
    headers += ["calls", "mask s"]
    rows = [
        [
            name,
            fmt(r["requests_per_s"], 2),
            fmt(r["tokens_per_s"]),
            fmt(r["latency_p50_ms"]),
            fmt(r["latency_p90_ms"]),
            fmt(r["first_chunk_p50_ms"]),
            str(r["calls"]),
            fmt(r["mask_s"], 3),
        ]
        for name, r in results.items()
        if name != "server"
    ]
    print(f"concurrency {args.concurrency}, {args.requests} requests a round, greedy")
    print_table(headers, rows)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
