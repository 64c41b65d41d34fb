"""Streams whose clients never read: how long a normal request then waits.

    .venv/bin/python bench/slow_readers.py [--model PATH] [--dtype bfloat16]
        [--streams 64,200] [--max-tokens 1500] [--tensor-parallel-size 1] [--json out.json]

One server (the default model unless `--model`). For each count in `--streams`: that many
streaming completions (`max_tokens` each) from clients whose sockets have a 4 KiB receive
buffer and are never read, all sent, then at once one ordinary 4-token request; printed: its
latency, how long until every stream was paused (the server's `requests_paused` gauge), the
requests running then, and the latency of another 4-token request sent once all of them are
paused. The streams are closed before the next count. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any

import httpx
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

RECEIVE_BUFFER_BYTES = 4096
PAUSED_WAIT_S = 300.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument("--streams", default="64,200", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    return parser.parse_args(argv)


def _never_reading(port: int, model: str, max_tokens: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _one_count(server: ServerProcess, model: str, num: int, max_tokens: int) -> dict[str, Any]:
    streams = [_never_reading(server.port, model, max_tokens) for _ in range(num)]
    sent_at = time.monotonic()
    try:
        status, latency = _normal_request(server, model)
        paused_s = after_paused = None
        while time.monotonic() - sent_at < PAUSED_WAIT_S:
            if metric_value(server.base_url, "otel_engine_requests_paused") >= num:
                paused_s = time.monotonic() - sent_at
                break
            time.sleep(0.1)
        running = metric_value(server.base_url, "otel_engine_requests_running")
        if paused_s is not None:
            after_paused = _normal_request(server, model)[1]
    finally:
        for sock in streams:
            sock.close()
    deadline = time.monotonic() + 60
    while metric_value(server.base_url, "otel_engine_requests_paused") > 0:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {
        "streams": num,
        "status": status,
        "normal_request_s": round(latency, 2),
        "all_paused_s": None if paused_s is None else round(paused_s, 2),
        "running_when_paused": running,
        "normal_request_once_paused_s": None if after_paused is None else round(after_paused, 3),
    }


def _normal_request(server: ServerProcess, model: str) -> tuple[int, float]:
    """An ordinary 4-token completion: its status and latency."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    started = time.monotonic()
    response = httpx.post(
        server.base_url + "/v1/completions", json=body, timeout=900, trust_env=False
    )
    return response.status_code, time.monotonic() - started


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size)]
    flags += ["--model", args.model] if args.model else []
    server = ServerProcess(flags, free_port())
    results: dict[str, Any] = {"tensor_parallel_size": args.tensor_parallel_size, "runs": []}
    try:
        results["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        for num in (int(n) for n in args.streams.split(",")):
            results["runs"].append(_one_count(server, model, num, args.max_tokens))
    finally:
        results["shutdown"] = server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_benchmark(args.model)
    results = run(args)
    print(
        f"\n== never-reading streams, max_tokens {args.max_tokens}, TP {args.tensor_parallel_size}"
    )
    print_table(
        ["streams", "4-token request s", "all paused after s", "running then", "then a request s"],
        [
            [
                str(r["streams"]),
                fmt(r["normal_request_s"], 2),
                fmt(r["all_paused_s"], 2),
                fmt(r["running_when_paused"], 0),
                fmt(r["normal_request_once_paused_s"], 3),
            ]
            for r in results["runs"]
        ],
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
