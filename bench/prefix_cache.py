"""Prefix caching over HTTP: time to first token with the cache on and off.

    .venv/bin/python bench/prefix_cache.py [--model PATH] [--dtype bfloat16]
        [--prefix-len 1500] [--turns 6] [--json out.json]

Two servers run one after the other (`--enable-prefix-caching`, then
`--no-enable-prefix-caching`), each through two scenarios:
1. shared prefix: a streamed `/v1/completions` request whose prompt is `--prefix-len` random
   tokens plus 16 more, then a second one with the same prefix and 16 other tokens; TTFT of
   both and the second's `usage.prompt_tokens_details.cached_tokens`;
2. chat: a conversation of `--turns` turns with a long system prompt, each turn resending the
   whole history (the model's own replies included) to `/v1/chat/completions`; TTFT and
   cached tokens per turn.
Then the server's prefix cache counters from /metrics. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import httpx
from common import (
    ServerProcess,
    fmt,
    free_port,
    print_table,
    random_prompts,
    served_model_name,
    server_parser,
    start_benchmark,
    write_json,
)

SEED = 4321
SUFFIX_LEN = 16
WORDS = [
    "engine",
    "request",
    "token",
    "block",
    "cache",
    "prefix",
    "step",
    "batch",
    "model",
    "worker",
    "schedule",
    "stream",
    "latency",
    "memory",
    "kernel",
    "queue",
    "metric",
    "trace",
    "span",
    "failure",
    "dump",
    "operator",
    "signal",
    "budget",
    "throughput",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument("--prefix-len", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--reply-tokens", type=int, default=48)
    return parser.parse_args(argv)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _stream(client: Any, kind: str, **body: Any) -> dict[str, Any]:
    """One streamed request: TTFT (first content), cached prompt tokens, the reply text."""
    start = time.perf_counter()
    ttft = None
    text = []
    cached = prompt_tokens = None
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    stream = create(stream=True, stream_options={"include_usage": True}, temperature=0.0, **body)
    for chunk in stream:
        if chunk.choices:
            piece = chunk.choices[0].delta.content if kind == "chat" else chunk.choices[0].text
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(piece)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = details.cached_tokens if details is not None else None
    return {
        "ttft_ms": round(1000 * (ttft if ttft is not None else time.perf_counter() - start), 1),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "text": "".join(text),
    }


def shared_prefix(client: Any, model: str, args: argparse.Namespace, vocab: int) -> list[Any]:
    prefix = random_prompts(1, args.prefix_len, vocab, SEED)[0]
    suffixes = random_prompts(2, SUFFIX_LEN, vocab, SEED + 1)
    results = []
    for suffix in suffixes:
        result = _stream(client, "completion", model=model, prompt=prefix + suffix, max_tokens=8)
        result.pop("text")
        results.append(result)
    return results


def chat(client: Any, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    messages = [{"role": "system", "content": "You answer questions. " + _words(rng, 400)}]
    turns = []
    for _ in range(args.turns):
        messages.append({"role": "user", "content": _words(rng, 40) + "?"})
        result = _stream(
            client, "chat", model=model, messages=messages, max_tokens=args.reply_tokens
        )
        messages.append({"role": "assistant", "content": result.pop("text")})
        turns.append(result)
    return turns


def _counters(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    wanted = ("otel_engine_prefix_cache_queries_total", "otel_engine_prefix_cache_hits_total")
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


def run_server(args: argparse.Namespace, caching: bool, vocab: int) -> dict[str, Any]:
    from openai import DefaultHttpxClient, OpenAI

    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    flags.append("--enable-prefix-caching" if caching else "--no-enable-prefix-caching")
    server = ServerProcess(flags, free_port())
    label = "on" if caching else "off"
    result: dict[str, Any] = {"prefix_caching": caching}
    try:
        result["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        with OpenAI(
            base_url=server.base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=600.0,
            http_client=DefaultHttpxClient(trust_env=False),  # loopback: never via a proxy
        ) as client:
            _stream(client, "completion", model=model, prompt=[1000, 1001, 1002], max_tokens=4)
            result["shared_prefix"] = shared_prefix(client, model, args, vocab)
            print(f"[cache {label}] shared prefix: {result['shared_prefix']}", flush=True)
            result["chat"] = chat(client, model, args)
            print(f"[cache {label}] chat: {result['chat']}", flush=True)
        result["metrics"] = _counters(server.base_url)
    finally:
        result["shutdown"] = server.stop()
    return result


def print_summary(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    on, off = results["on"], results["off"]
    print(f"\n== shared prefix of {args.prefix_len} tokens + {SUFFIX_LEN} (TTFT ms)")
    rows = []
    for label, run in (("on", on), ("off", off)):
        first, second = run["shared_prefix"]
        ratio = second["ttft_ms"] / first["ttft_ms"]
        rows.append(
            [
                label,
                fmt(first["ttft_ms"]),
                fmt(second["ttft_ms"]),
                f"{ratio:.0%}",
                str(second["cached_tokens"]),
            ]
        )
    print_table(["cache", "first", "second", "second/first", "cached tokens"], rows)
    print(f"\n== chat, {args.turns} turns, each resending the history (TTFT ms)")
    rows = []
    for index, (a, b) in enumerate(zip(on["chat"], off["chat"], strict=True)):
        rows.append(
            [
                str(index + 1),
                str(a["prompt_tokens"]),
                fmt(a["ttft_ms"]),
                str(a["cached_tokens"]),
                fmt(b["ttft_ms"]),
            ]
        )
    print_table(["turn", "prompt tokens", "on", "cached", "off"], rows)
    print(f"\n/metrics with the cache on: {on['metrics']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = start_benchmark(args.model)
    results = {"on": run_server(args, True, vocab), "off": run_server(args, False, vocab)}
    print_summary(results, args)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
