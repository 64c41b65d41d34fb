"""What telemetry costs: serving throughput with traces, JSON logs and metrics on vs. all off.

    .venv/bin/python bench/telemetry_cost.py [--model PATH | --tiny] [--concurrency 32]
        [--requests-per-client 2] [--prompt-len 128] [--output-len 128] [--rounds 3]
        [--threads N] [--json out.json]

Two `otel-engine serve` processes run side by side, idle except when measured:
- off: no OTLP endpoint (no tracer provider: the API's no-op spans), `--log-level WARNING`
  (no per-request log lines), nothing scrapes `/metrics` or exports it;
- on:  spans of every process exported over OTLP/gRPC to a local receiver (a separate process,
  the SDK's default batch settings), `--log-format json --log-level INFO` (a file), OTLP metric
  export every 5 s (`OTEL_METRIC_EXPORT_INTERVAL=5000`) and a `/metrics` scrape every second.
Metrics are always recorded by the server (there is no switch); "off" only leaves them unread.

After one warm-up round per mode, rounds alternate off, on, off, on, ... with the same prompts
(concurrency C clients, streaming `/v1/completions`, greedy, `ignore_eos`), with a pause after
each so that the "on" server's batched export never runs during an "off" round; output
tokens/s per round, and the CPU time the server's process tree spent per output token (which
other work on the machine disturbs less than throughput). The best and the median per mode
and the loss in % are printed side by side. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import ServerProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
SEED = 4321
MODES = ("off", "on")


def _receiver_main() -> None:
    """`--receiver` mode: an OTLP/gRPC receiver until stdin closes; prints what it got."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.otlp_receiver import OtlpReceiver

    with OtlpReceiver("grpc") as receiver:
        print(receiver.port, flush=True)
        sys.stdin.read()
        num_spans = sum(
            len(scope.spans)
            for request in receiver.requests["traces"]
            for resource in request.resource_spans
            for scope in resource.scope_spans
        )
        counts = {"spans": num_spans, "metric_exports": len(receiver.requests["metrics"])}
    print(json.dumps(counts), flush=True)


class Receiver:
    """The receiver in its own process (so it does not share the client's interpreter)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--receiver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdout is not None
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def close(self) -> dict[str, Any]:
        out, _ = self.proc.communicate(timeout=60)
        return dict(json.loads(out.strip().splitlines()[-1]))


def _server_args(args: argparse.Namespace, model: str | None) -> list[str]:
    flags = ["--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size)]
    flags += ["--max-num-seqs", str(max(64, args.concurrency))]
    return flags + (["--model", model] if model else [])


def _start(mode: str, flags: list[str], endpoint: str, threads: int | None) -> ServerProcess:
    """A server with telemetry `mode`; the environment is set only around the spawn."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        if mode == "on":
            os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = "5000"
            extra = ["--otlp-endpoint", endpoint, "--log-format", "json", "--log-level", "INFO"]
        else:
            extra = ["--log-format", "json", "--log-level", "WARNING"]
        return ServerProcess([*flags, *extra], free_port())
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> int:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def _load(
    base_url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> tuple[int, float]:
    """Send every prompt with `concurrency` clients; (output tokens, wall seconds)."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    total = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=600, limits=limits, trust_env=False
    ) as client:

        async def worker() -> None:
            nonlocal total
            while not queue.empty():
                tokens = await _one(client, model, queue.get_nowait(), max_tokens)
                total += tokens  # after the await: `total += await ...` would lose updates

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total, time.perf_counter() - start


def _scrape(base_url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=base_url, timeout=10, trust_env=False) as client:
        while not stop.wait(1.0):
            with contextlib.suppress(httpx.HTTPError):
                client.get("/metrics")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants so far."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def _round(
    mode: str, server: ServerProcess, model: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, float]:
    """One measured load: output tok/s, and the server tree's CPU ms per output token."""
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(server.base_url, stop), daemon=True)
    if mode == "on":
        scraper.start()
    cpu_before = _cpu_seconds(server.proc.pid)
    try:
        tokens, wall = asyncio.run(
            _load(server.base_url, model, prompts, args.concurrency, args.output_len)
        )
    finally:
        stop.set()
        if scraper.is_alive():
            scraper.join()
    time.sleep(args.settle_s)  # the batched export of this round's spans is the server's too
    cpu_ms = 1000 * (_cpu_seconds(server.proc.pid) - cpu_before) / max(1, tokens)
    tok_s = tokens / wall
    print(
        f"[{mode:>3}] {len(prompts)} requests, {tokens} tokens in {wall:.2f} s = "
        f"{tok_s:.1f} tok/s; server CPU {cpu_ms:.3f} ms/token",
        flush=True,
    )
    return {"tok_s": tok_s, "cpu_ms_per_token": cpu_ms}


def _tiny_model(tmp: str) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.tiny_model import write_tiny_llama

    return str(write_tiny_llama(Path(tmp)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="otel-telemetry-cost-")
    model_path = _tiny_model(tmp) if args.tiny else args.model
    receiver = Receiver()
    flags = _server_args(args, model_path)
    servers = {mode: _start(mode, flags, receiver.endpoint, args.threads) for mode in MODES}
    report: dict[str, Any] = {"rounds": {mode: [] for mode in MODES}}
    try:
        for mode, server in servers.items():
            print(
                f"[{mode:>3}] ready in {server.wait_ready(args.startup_timeout):.1f} s", flush=True
            )
        info = httpx.get(servers["off"].base_url + "/v1/models", timeout=10).json()["data"][0]
        model = info["id"]
        prompts = _prompts(
            args.concurrency * args.requests_per_client, args.prompt_len, model_path, SEED
        )
        for mode in MODES:  # a full round each: allocator and kernels see the real shapes
            print(f"[{mode:>3}] warm-up", flush=True)
            _round(mode, servers[mode], model, prompts, args)
        for _ in range(args.rounds):
            for mode in MODES:
                report["rounds"][mode].append(_round(mode, servers[mode], model, prompts, args))
    finally:
        for mode, server in servers.items():
            report[f"shutdown_{mode}"] = server.stop()
        report["receiver"] = receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report.update(
        model=model_path or "default (SmolLM2-135M-Instruct)",
        concurrency=args.concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        cpu_count=os.cpu_count(),
        load_average=os.getloadavg(),
    )
    return report


def _prompts(num: int, length: int, model: str | None, seed: int) -> list[list[int]]:
    """Random token-id prompts from the upper three quarters of the vocabulary (clear of
    special tokens, also for the tiny model's 768-token vocabulary)."""
    sys.path.insert(0, str(ROOT))
    from otel_engine.model.arch import load_model_arch
    from otel_engine.model.loader import prepare_model_dir

    vocab = load_model_arch(prepare_model_dir(model)).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(vocab // 4, vocab) for _ in range(length)] for _ in range(num)]


def summarize(report: dict[str, Any]) -> None:
    """Best and median tok/s per mode and the loss; CPU per token, which other load on the
    machine disturbs far less than throughput."""
    rounds = report["rounds"]
    tok_s = {mode: [r["tok_s"] for r in rounds[mode]] for mode in MODES}
    cpu = {mode: [r["cpu_ms_per_token"] for r in rounds[mode]] for mode in MODES}
    rows = {
        "best tok/s": {mode: max(tok_s[mode]) for mode in MODES},
        "median tok/s": {mode: statistics.median(tok_s[mode]) for mode in MODES},
    }
    print(
        f"\n== telemetry cost: {report['model']}, concurrency {report['concurrency']}, "
        f"prompt {report['prompt_len']} + output {report['output_len']} tokens, "
        f"{report['cpu_count']} CPUs, load average after {report['load_average'][0]:.2f}"
    )
    print(f"{'':>26}{'all off':>10}{'all on':>10}{'loss':>9}")
    for label, values in rows.items():
        loss = 100 * (values["off"] - values["on"]) / values["off"]
        report[f"loss_pct_{label.split()[0]}"] = round(loss, 2)
        print(f"{label:>26}{values['off']:>10.1f}{values['on']:>10.1f}{loss:>8.1f}%")
    cpu_median = {mode: statistics.median(cpu[mode]) for mode in MODES}
    extra = 100 * (cpu_median["on"] - cpu_median["off"]) / cpu_median["off"]
    report["cpu_extra_pct_median"] = round(extra, 2)
    print(
        f"{'median server CPU ms/token':>26}{cpu_median['off']:>10.3f}"
        f"{cpu_median['on']:>10.3f}{extra:>+8.1f}%"
    )
    for mode in MODES:
        print(
            f"rounds {mode:>3}: "
            + ", ".join(
                f"{r['tok_s']:.1f} tok/s ({r['cpu_ms_per_token']:.3f} ms)" for r in rounds[mode]
            )
        )
    print(f"receiver got: {report['receiver']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="HF directory or .gguf file (default: the default model)")
    which.add_argument(
        "--tiny",
        action="store_true",
        help="the tests' random 2-layer model: quick; telemetry weighs most",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16")
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--threads",
        type=int,
        help="OMP_NUM_THREADS for the servers (1 makes the numbers far steadier "
        "when other work shares the CPU: no spinning OpenMP threads)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="measurements per mode")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=6.0,
        help="pause after each round, longer than the span batch delay (5 s), "
        "so that one mode's export does not run during the other's round",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if argv is None and sys.argv[1:] == ["--receiver"]:
        _receiver_main()
        return 0
    args = parse_args(argv)
    report = run(args)
    summarize(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
