"""Hostile clients, round three: what each reproduction costs its neighbours.

    PYTHONPATH=/path/to/checkout python bench/hostile_clients.py [--formats hermes,generic]
        [--seconds 5] [--concurrency 4] [--json out.json]

For each tool format (`hermes`: the tiny model with Qwen2.5's tool markup; `generic`: the tiny
model whose template teaches none), one `otel-engine serve` of the checkout that PYTHONPATH
names (the server runs in a scratch directory, so the current directory does not choose the
code). First an ordinary 4-token completion alone (its median latency), then each
reproduction while a probe process asks `/health` every 20 ms and a thread sends an ordinary
4-token completion every 0.25 s:

- `tool_history`: `--concurrency` chats whose history is 2,048 assistant messages of empty
  tool calls, as many as a 4 MB body holds;
- `client_mistakes`: tool-call arguments nested 1,200 deep (unbalanced) and 900 deep
  (balanced), lone surrogates in decoded arguments and in Responses items, text parts nested
  in text parts, on chat, /tokenize and Responses (each once);
- `error_flood`: `--concurrency` clients posting the bodies of `client_mistakes` and other
  bad bodies as fast as they are answered, for `--seconds`;
- `trickling_readers`: 8 streams whose clients read 256 bytes every 0.5 s, for
  `--trickle-seconds` (their streams pause and resume over and over);
- `many_tools`: `--concurrency` chats with 128 distinct tools whose prompt is past the context.

Printed per reproduction: the status codes, how many were 500, the normal request's median and
worst latency beside it (and the difference from alone), /health's worst latency, the
server's log bytes per second while it ran, and its `request.internal_error`,
`request.failed` and `request.paused` lines. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

import httpx

try:  # the checkout PYTHONPATH names; else the one this script is in
    import otel_engine
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import otel_engine

# The lines a client can make the server write over and over, counted per reproduction.
COUNTED_EVENTS = ("request.internal_error", "request.failed", "request.paused")
NORMAL_INTERVAL_S = 0.25
HEALTH_INTERVAL_S = 0.02
BASELINE_REQUESTS = 8
MAX_BODY_BYTES = 4 * 1024 * 1024
READERS = 8
READ_BYTES, READ_INTERVAL_S = 256, 0.5

# ---- the bodies -----------------------------------------------------------------------------


def tool_history_body() -> bytes:
    """2,048 assistant messages of empty tool calls, as many calls each as fit in 4 MB."""
    call = '{"id":"c","type":"function","function":{"name":"f","arguments":""}}'
    head, tail = '{"max_tokens":4,"messages":[', "]}"
    per_message = (MAX_BODY_BYTES - 4096) // 2048
    num_calls = (per_message - 50) // (len(call) + 1)
    message = '{"role":"assistant","content":"","tool_calls":[' + ",".join([call] * num_calls)
    message += "]}"
    return (head + ",".join([message] * 2048) + tail).encode()


def many_tools_body(seed: int) -> bytes:
    """128 tools with distinct schemas, whose definitions are past a 4,096-token context."""
    tools = []
    for index in range(128):
        properties = {
            f"field_{seed}_{index}_{k}": {"type": "string", "description": "x" * 40}
            for k in range(4)
        }
        schema = {"type": "object", "properties": properties, "required": list(properties)}
        tools.append({"type": "function", "function": {"name": f"f{index}", "parameters": schema}})
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 4,
    }
    return json.dumps(body).encode()


def _chat(arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
        "max_tokens": 4,
    }


def _responses(arguments: str) -> dict[str, Any]:
    return {
        "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "max_output_tokens": 4,
    }


def mistake_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of client mistakes that were answered 500."""
    arguments = {
        "open_1200": "[" * 1200,
        "balanced_900": "[" * 900 + "]" * 900,
        "surrogate_string": '"\\ud800"',
        "surrogate_in_object": '{"a": "\\udc00"}',
    }
    cases: list[tuple[str, str, bytes]] = []
    for name, text in arguments.items():
        chat = _chat(text)
        tokenize = {key: value for key, value in chat.items() if key != "max_tokens"}
        for path, body in (
            ("/v1/chat/completions", chat),
            ("/tokenize", tokenize),
            ("/v1/responses", _responses(text)),
        ):
            cases.append((name, path, json.dumps(body).encode()))
    raw_items = {
        "responses_surrogate_content": '{"role": "user", "content": "\\ud800"}',
        "responses_surrogate_part": (
            '{"role": "user", "content": [{"type": "input_text", "text": "\\ud800"}]}'
        ),
        "responses_surrogate_call_id": (
            '{"type": "function_call", "call_id": "\\ud800", "name": "f", "arguments": "{}"}'
        ),
        "responses_surrogate_name": (
            '{"type": "function_call", "call_id": "c", "name": "\\ud800", "arguments": "{}"}'
        ),
        "responses_surrogate_output": (
            '{"type": "function_call_output", "call_id": "c", "output": "\\udfff"}'
        ),
        "responses_nested_parts": (
            '{"role": "user", "content": [{"type": "input_text", "text": '
            + '[{"type": "text", "text": ' * 200
            + '"x"'
            + "}]" * 200
            + "}]}"
        ),
    }
    for name, item in raw_items.items():
        body = '{"max_output_tokens": 4, "input": [' + item + "]}"
        cases.append((name, "/v1/responses", body.encode()))
    return cases


def flood_bodies() -> list[tuple[str, bytes]]:
    """What the flood posts: the client mistakes and ordinary bad bodies."""
    bodies = [(path, body) for _, path, body in mistake_bodies()]
    bodies += [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}'),
        ("/v1/chat/completions", b'{"messages": []}'),
        ("/v1/completions", b"{not json"),
    ]
    return bodies


# ---- measuring ------------------------------------------------------------------------------


class Server:
    """`otel-engine serve` from the checkout on sys.path, in a scratch directory, its output
    in a log file whose growth is the log volume."""

    def __init__(self, model: str, scratch: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = scratch / f"server-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(Path(otel_engine.__file__).parents[1])}
        env.setdefault("HF_HUB_OFFLINE", "1")
        command = [sys.executable, "-m", "otel_engine.cli", "serve", "--model", model]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=scratch, env=env,
                start_new_session=True,
            )  # fmt: skip

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2, trust_env=False).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not become healthy")

    @property
    def log_bytes(self) -> int:
        return self.log_path.stat().st_size

    def events_since(self, offset: int, events: tuple[str, ...]) -> dict[str, int]:
        """How many lines of each of `events` the log has past byte `offset`."""
        with self.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        return {event: text.count(f'"event": "{event}"') for event in events}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def normal_request(base_url: str) -> float:
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    started = time.perf_counter()
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=300, trust_env=False)
    response.raise_for_status()
    return time.perf_counter() - started


_HEALTH_PROBE = """
import json, sys, threading, time
import httpx
base_url, interval = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
latencies = []
with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as client:
    client.get("/health")
    print("ready", flush=True)
    while not stop.wait(interval):
        started = time.perf_counter()
        client.get("/health")
        latencies.append(time.perf_counter() - started)
print(json.dumps(latencies), flush=True)
"""


@contextmanager
def neighbours(base_url: str, found: dict[str, Any]) -> Iterator[None]:
    """While the block runs: /health from another process every 20 ms, and a normal 4-token
    request every 0.25 s from a thread; their latencies land in `found`."""
    probe = subprocess.Popen(
        [sys.executable, "-c", _HEALTH_PROBE, base_url, str(HEALTH_INTERVAL_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert probe.stdin is not None
    assert probe.stdout is not None
    assert probe.stdout.readline().strip() == "ready"
    stop = threading.Event()
    normal: list[float] = []

    def send_normal() -> None:
        while not stop.is_set():
            normal.append(normal_request(base_url))
            stop.wait(NORMAL_INTERVAL_S)

    thread = threading.Thread(target=send_normal, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        probe.stdin.close()
        health = json.loads(probe.stdout.readline())
        probe.wait()
        found["normal_s"] = normal
        found["health_s"] = health


async def post_all(base_url: str, cases: list[tuple[str, bytes]]) -> list[int]:
    """Post every (path, body) at once; their status codes."""
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False) as client:
        answers = await asyncio.gather(
            *(client.post(path, content=body, headers=headers) for path, body in cases)
        )
    return [answer.status_code for answer in answers]


async def flood(base_url: str, clients: int, seconds: float) -> list[int]:
    """`clients` connections posting `flood_bodies()` in turn for `seconds`; status codes."""
    bodies = flood_bodies()
    headers = {"content-type": "application/json"}
    statuses: list[int] = []
    deadline = time.monotonic() + seconds

    async def one(offset: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=600, trust_env=False) as client:
            index = offset
            while time.monotonic() < deadline:
                path, body = bodies[index % len(bodies)]
                statuses.append(
                    (await client.post(path, content=body, headers=headers)).status_code
                )
                index += 1

    await asyncio.gather(*(one(k) for k in range(clients)))
    return statuses


def trickle(port: int, seconds: float) -> list[int]:
    """`READERS` streamed completions whose clients read `READ_BYTES` every `READ_INTERVAL_S`;
    their status codes (from the response head)."""
    body = json.dumps(
        {"prompt": "Once", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    ).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(READERS):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(head + body)
        socks.append(sock)
    firsts = [b""] * READERS
    deadline = time.monotonic() + seconds
    for sock in socks:
        sock.setblocking(False)
    while time.monotonic() < deadline:
        for index, sock in enumerate(socks):
            try:
                chunk = sock.recv(READ_BYTES)
            except BlockingIOError:
                continue
            if len(firsts[index]) < 16:
                firsts[index] += chunk
        time.sleep(READ_INTERVAL_S)
    for sock in socks:
        sock.close()
    return [int(first.split(b" ")[1]) if first.count(b" ") else 0 for first in firsts]


def measure(server: Server, name: str, action: Callable[[], list[int]]) -> dict[str, Any]:
    found: dict[str, Any] = {"reproduction": name}
    log_before = server.log_bytes
    started = time.monotonic()
    with neighbours(server.base_url, found):
        statuses = action()
    seconds = time.monotonic() - started
    time.sleep(0.5)  # the last lines of the reproduction reach the log
    found["seconds"] = round(seconds, 2)
    found["statuses"] = dict(Counter(statuses))
    found["num_500"] = sum(1 for status in statuses if status == 500)
    found["log_bytes_per_s"] = round((server.log_bytes - log_before) / seconds)
    found["log_lines"] = server.events_since(log_before, COUNTED_EVENTS)
    return found


def run_format(kind: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    from tests.helpers.tiny_model import write_tiny_llama, write_tiny_tool_model

    model_dir = scratch / f"model-{kind}"
    if kind == "hermes":
        model = write_tiny_tool_model(model_dir)
    else:
        model = write_tiny_llama(model_dir, context=4096)
    server = Server(model, scratch)
    results: dict[str, Any] = {"format": kind, "runs": []}
    try:
        server.wait_healthy()
        normal_request(server.base_url)  # warm
        alone = [normal_request(server.base_url) for _ in range(BASELINE_REQUESTS)]
        results["normal_alone_s"] = round(median(alone), 4)
        history = tool_history_body()
        mistakes = mistake_bodies()
        actions: dict[str, Callable[[], list[int]]] = {
            "tool_history": lambda: asyncio.run(
                post_all(server.base_url, [("/v1/chat/completions", history)] * args.concurrency)
            ),
            "client_mistakes": lambda: asyncio.run(
                post_all(server.base_url, [(path, body) for _, path, body in mistakes])
            ),
            "error_flood": lambda: asyncio.run(
                flood(server.base_url, args.concurrency, args.seconds)
            ),
            "trickling_readers": lambda: trickle(server.port, args.trickle_seconds),
            "many_tools": lambda: asyncio.run(
                post_all(
                    server.base_url,
                    [("/v1/chat/completions", many_tools_body(k)) for k in range(args.concurrency)],
                )
            ),
        }
        for name in args.reproductions.split(","):
            results["runs"].append(measure(server, name, actions[name]))
        results["mistakes"] = _each_mistake(server.base_url, mistakes)
    finally:
        server.stop()
        if args.keep_log:
            shutil.copy(server.log_path, Path(args.keep_log) / f"server-{kind}.log")
    return results


def _each_mistake(base_url: str, cases: list[tuple[str, str, bytes]]) -> list[str]:
    lines = []
    with httpx.Client(base_url=base_url, timeout=300, trust_env=False) as client:
        for name, path, body in cases:
            response = client.post(path, content=body, headers={"content-type": "application/json"})
            code = response.json().get("error", {}).get("code") if response.is_error else ""
            lines.append(f"{response.status_code} {path} {name} {code or ''}".rstrip())
    return lines


def _ms(values: list[float], pick: Callable[[list[float]], float]) -> str:
    return "-" if not values else f"{1000 * pick(values):.0f}"


def report(results: dict[str, Any]) -> None:
    alone = results["normal_alone_s"]
    print(f"\n== {results['format']}: a normal 4-token request alone {1000 * alone:.0f} ms")
    headers = ["reproduction", "s", "statuses", "500s", "normal med/max ms", "vs alone ms"]
    headers += ["health max ms", "log B/s", "internal_error/failed/paused lines"]
    rows = []
    for run in results["runs"]:
        normal = run["normal_s"]
        statuses = " ".join(f"{code}x{n}" for code, n in sorted(run["statuses"].items()))
        rows.append(
            [
                run["reproduction"],
                f"{run['seconds']:.1f}",
                statuses,
                str(run["num_500"]),
                f"{_ms(normal, median)}/{_ms(normal, max)}",
                "-" if not normal else f"{1000 * (max(normal) - alone):+.0f}",
                _ms(run["health_s"], max),
                str(run["log_bytes_per_s"]),
                "/".join(str(n) for n in run["log_lines"].values()),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    print("each client mistake once:")
    for line in results["mistakes"]:
        print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--formats", default="hermes,generic")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--trickle-seconds", type=float, default=15.0, help="long enough for pauses to start"
    )
    parser.add_argument(
        "--reproductions",
        default="tool_history,client_mistakes,error_flood,trickling_readers,many_tools",
    )
    parser.add_argument("--keep-log", metavar="DIR", help="copy each server's log here")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    print(f"otel_engine from {Path(otel_engine.__file__).parent}")
    everything = []
    with tempfile.TemporaryDirectory(prefix="otel-bench-hostile-") as scratch:
        for kind in args.formats.split(","):
            results = run_format(kind, args, Path(scratch))
            report(results)
            everything.append(results)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
