"""Recovery in place: how long an engine failure pauses every stream, and what restarts leave.

    .venv/bin/python bench/recovery.py [--model PATH|tiny] [--streams 32]
        [--tensor-parallel-size 1] [--kill otel-engine-core | --fault SPEC]
        [--restarts 100] [--json out.json]

Pause (default): start `otel-engine serve --on-engine-failure restart` (the default model
unless --model), open N streaming `/v1/completions` (greedy, `ignore_eos`), wait until every
stream has tokens, then fail the engine: SIGKILL the process titled --kill (as the OOM killer
would), or `OTEL_ENGINE_FAULT=SPEC` set from the start (add `:restart=0` so that only the
first engine fails; the failure's time is its `fault.injected` line). For each stream: the
pause, from the failure to its first token after the restart. Printed: its quantiles, where
the time went (the server's log: the failure noticed, `engine.restarting`; the new engine
ready, `engine.recovered`), and how every stream ended (all must finish: none failed, none
lost).

Restarts (`--restarts K`): with no traffic, SIGKILL the engine core K times, each time waiting
for `/health`; the api_server's open fds, threads, RSS and processes under it (the engine
core, its workers, the spare engine core) after the first restart and after
every tenth, and one greedy request's text before and after, which must be the same.
Numbers only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import psutil
from common import ServerProcess, fmt, free_port, print_table, quantile, tiny_model, write_json

PROMPT = (
    "A server that survives its own engine: when the engine core dies, the api_server keeps "
    "every connection, starts a new engine and carries each request over as its prompt and "
    "the tokens it had sent. "
)
RESTART_FLAGS = ["--on-engine-failure", "restart", "--engine-restart-window", "1"]


@dataclass
class Stream:
    """One streaming client: when each chunk came and how it ended."""

    chunks: list[float] = field(default_factory=list)
    outcome: str = "running"  # done, error_event, http_<status>, transport_error, timeout
    message: str = ""


async def _stream(client: httpx.AsyncClient, body: dict[str, Any], stream: Stream) -> None:
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stream.outcome = f"http_{response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    stream.outcome = "done"
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    stream.outcome, stream.message = "error_event", event["error"]["code"]
                    return
                stream.chunks.append(time.time())
    except httpx.HTTPError as error:
        stream.outcome, stream.message = "transport_error", type(error).__name__


async def _crowd(
    server: ServerProcess, args: argparse.Namespace
) -> tuple[list[Stream], float | None]:
    body = {
        "prompt": PROMPT * 3,
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    streams = [Stream() for _ in range(args.streams)]
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(
        base_url=server.base_url,
        timeout=httpx.Timeout(args.client_timeout, connect=30),
        limits=limits,
        trust_env=False,
    ) as client:
        tasks = [asyncio.create_task(_stream(client, body, s)) for s in streams]
        deadline = time.monotonic() + args.client_timeout
        while not all(len(s.chunks) >= args.tokens_before for s in streams):
            if time.monotonic() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        killed_at = None
        if args.fault is None:
            target = server.find(args.kill)
            killed_at = time.time()
            os.kill(target.pid, signal.SIGKILL)
        _, pending = await asyncio.wait(tasks, timeout=args.client_timeout)
        for task in pending:
            task.cancel()
    for stream in streams:
        if stream.outcome == "running":
            stream.outcome = "timeout"
    return streams, killed_at


def _log(path: str, events: tuple[str, ...]) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """time.time() and fields of every log line of these events."""
    found: dict[str, list[tuple[float, dict[str, Any]]]] = {event: [] for event in events}
    with open(path, errors="replace") as file:
        for line in file:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") in found:
                stamp = record["timestamp"].replace("Z", "+00:00")
                found[record["event"]].append((datetime.fromisoformat(stamp).timestamp(), record))
    return found


def _flags(args: argparse.Namespace) -> list[str]:
    flags = [*RESTART_FLAGS, "--max-engine-restarts", str(max(args.restarts, 3))]
    flags += ["--tensor-parallel-size", str(args.tensor_parallel_size), "--log-level", "INFO"]
    flags += ["--max-num-seqs", str(max(args.streams, 1))]
    return flags + (["--model", args.model] if args.model else [])


def run_pause(args: argparse.Namespace) -> dict[str, Any]:
    env = {"OTEL_ENGINE_FAULT": args.fault} if args.fault else None
    server = ServerProcess(_flags(args), free_port(), env=env)
    try:
        ready = server.wait_ready(args.startup_timeout)
        print(f"server ready in {ready:.1f} s; {args.streams} streams", flush=True)
        time.sleep(args.settle)  # the spare engine core imports meanwhile
        streams, killed_at = asyncio.run(_crowd(server, args))
        log = _log(
            str(server.log_path),
            ("fault.injected", "engine.restarting", "engine.recovered", "engine_core.died"),
        )
    finally:
        stop = server.stop(keep_log=True)
    injected = log["fault.injected"]
    fault_at = killed_at or (injected[0][0] if injected else None)
    if fault_at is None:
        raise RuntimeError(f"no failure happened; log: {stop.get('server_log')}")
    # The first token after the front end heard of the failure (nothing of the failed
    # engine comes after that), counted from the failure.
    restarting = log["engine.restarting"]
    after = restarting[0][0] if restarting else fault_at
    firsts = [next((t for t in s.chunks if t > after), None) for s in streams]
    pauses = [first - fault_at for first in firsts if first is not None]
    outcomes: dict[str, int] = {}
    for stream in streams:
        outcomes[stream.outcome] = outcomes.get(stream.outcome, 0) + 1
    recovered = log["engine.recovered"]
    return {
        "streams": args.streams,
        "tensor_parallel_size": args.tensor_parallel_size,
        "failure": args.fault or f"SIGKILL {args.kill}",
        "outcomes": outcomes,
        "tokens_per_stream": sorted({len(s.chunks) for s in streams}),
        "pause_s": {
            "p50": quantile(pauses, 0.5),
            "p90": quantile(pauses, 0.9),
            "p99": quantile(pauses, 0.99),
            "max": max(pauses, default=None),
        },
        "noticed_s": round(restarting[0][0] - fault_at, 3) if restarting else None,
        "engine_ready_s": round(recovered[0][0] - fault_at, 3) if recovered else None,
        "suspects": restarting[0][1].get("num_suspects") if restarting else None,
        "carried_over_at_once": recovered[0][1].get("num_requests") if recovered else None,
        "restarts": len(restarting),
        "exit_code": stop.get("exit_code"),
    }


def run_restarts(args: argparse.Namespace) -> dict[str, Any]:
    server = ServerProcess(_flags(args), free_port())
    samples: list[dict[str, Any]] = []
    try:
        server.wait_ready(args.startup_timeout)
        api = psutil.Process(server.pid)
        before = _greedy(server.base_url)
        for restart in range(1, args.restarts + 1):
            os.kill(server.find("otel-engine-core").pid, signal.SIGKILL)
            _wait_restarted(server, restart, args.startup_timeout)
            if restart == 1 or restart % 10 == 0:
                samples.append(
                    {
                        "restart": restart,
                        "fds": api.num_fds(),
                        "threads": api.num_threads(),
                        "rss_mib": round(api.memory_info().rss / 2**20, 1),
                        "processes": len(api.children(recursive=True)),
                    }
                )
                print(f"  {samples[-1]}", flush=True)
        after = _greedy(server.base_url)
    finally:
        stop = server.stop()
    return {
        "restarts": args.restarts,
        "samples": samples,
        "same_text_after": before == after,
        "exit_code": stop.get("exit_code"),
        "killed_leftovers": stop.get("killed_leftovers"),
    }


def _greedy(base_url: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120, trust_env=False)
    return str(response.json()["choices"][0]["text"])


def _wait_restarted(server: ServerProcess, restart: int, timeout: float) -> None:
    """Until the log has `restart` engine.recovered lines and /health answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.returncode is not None:
            raise RuntimeError(f"server exited with {server.returncode}:\n{server.tail()}")
        count = sum('"engine.recovered"' in line for line in server.lines())
        if count >= restart:
            server.wait_healthy(timeout=deadline - time.monotonic())
            return
        time.sleep(0.05)
    raise RuntimeError(f"restart {restart} did not end in {timeout} s:\n{server.tail()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        help="HF directory or .gguf, or `tiny` for the test suite's tiny model (default: the "
        "default model, whose 9 heads allow no tensor parallelism)",
    )
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kill", default="otel-engine-core", help="title of the process to kill")
    parser.add_argument("--fault", help="OTEL_ENGINE_FAULT instead of a SIGKILL")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--tokens-before", type=int, default=16, help="tokens each stream has before the failure"
    )
    parser.add_argument("--restarts", type=int, default=0, help="run the restarts series instead")
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds between the server's readiness and the streams, for its spare engine "
        "core to import (0: a failure right after the start, without a spare ready)",
    )
    parser.add_argument("--startup-timeout", type=float, default=300)
    parser.add_argument("--client-timeout", type=float, default=300)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model == "tiny":
        args.model = tiny_model()
    print(f"cpus={os.cpu_count()}; load={os.getloadavg()[0]:.2f}", flush=True)
    if args.restarts:
        result = run_restarts(args)
        rows = [
            [
                str(s["restart"]),
                str(s["fds"]),
                str(s["threads"]),
                fmt(s["rss_mib"]),
                str(s["processes"]),
            ]
            for s in result["samples"]
        ]
        print_table(["restart", "fds", "threads", "RSS MiB", "processes under it"], rows)
        print(f"same greedy text after: {result['same_text_after']}; exit {result['exit_code']}")
    else:
        result = run_pause(args)
        pause = result["pause_s"]
        print_table(
            [
                "streams",
                "TP",
                "failure",
                "noticed",
                "engine ready",
                "p50",
                "p90",
                "p99",
                "max",
                "outcomes",
            ],
            [
                [
                    str(result["streams"]),
                    str(result["tensor_parallel_size"]),
                    result["failure"],
                    fmt(result["noticed_s"], 2),
                    fmt(result["engine_ready_s"], 2),
                    fmt(pause["p50"], 2),
                    fmt(pause["p90"], 2),
                    fmt(pause["p99"], 2),
                    fmt(pause["max"], 2),
                    json.dumps(result["outcomes"]),
                ]
            ],
        )
        print(
            f"suspects: {result['suspects']}; carried over at once: "
            f"{result['carried_over_at_once']}; restarts: {result['restarts']}"
        )
    write_json(args.json, result)


if __name__ == "__main__":
    main()
