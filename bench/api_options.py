"""The cost of API options over HTTP: plain requests, `logprobs: 5`, and a JSON schema.

    .venv/bin/python bench/api_options.py [--model PATH] [--dtype bfloat16]
        [--concurrency 8] [--requests 16] [--output-len 128] [--repeat 2] [--json out.json]

One server (default model). After a warm-up, each variant sends `--requests` streamed
`/v1/completions` requests of 128 random prompt tokens from `--concurrency` client tasks
(greedy, `ignore_eos`; new prompts every time, so the prefix cache never helps), the
variants one after the other, `--repeat` rounds, the fastest round of each kept:
- `plain`: no option;
- `logprobs5`: `logprobs: 5` (the sampled token's logprob and the top 5 at every position);
- `json_schema`: `response_format` with a schema of an array of short strings; the request
  ends when its JSON is complete (or at the output length), so tokens per request vary:
  compare tokens per second and TPOT, not wall time.
Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from common import (
    ServerProcess,
    fmt,
    free_port,
    print_table,
    random_prompts,
    run_concurrency,
    served_model_name,
    server_parser,
    start_benchmark,
    write_json,
)

SEED = 2718
PROMPT_LEN = 128
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 40},
    },
    "required": ["title", "notes"],
    "additionalProperties": False,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs5": {"logprobs": 5},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    },
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    return parser.parse_args(argv)


def run(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    server = ServerProcess(flags, free_port())
    results: dict[str, Any] = {"variants": {}}
    try:
        results["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        for options in VARIANTS.values():  # warm-up: every path once, grammar compiled
            warm = random_prompts(args.concurrency, PROMPT_LEN, vocab, SEED)
            asyncio.run(run_concurrency(server.base_url, model, warm, args.concurrency, 8, options))
        for attempt in range(args.repeat):
            for index, (name, options) in enumerate(VARIANTS.items()):
                seed = SEED + 1 + attempt * len(VARIANTS) + index  # never a cached prefix
                prompts = random_prompts(args.requests, PROMPT_LEN, vocab, seed)
                level = asyncio.run(
                    run_concurrency(
                        server.base_url,
                        model,
                        prompts,
                        args.concurrency,
                        args.output_len,
                        options,
                    )
                )
                print(f"[{name}] round {attempt + 1}: {level}", flush=True)
                best = results["variants"].get(name)
                if best is None or level["tok_s"] > best["tok_s"]:
                    results["variants"][name] = level
    finally:
        results["shutdown"] = server.stop()
    return results


def print_summary(results: dict[str, Any], args: argparse.Namespace) -> None:
    variants = results["variants"]
    plain = variants["plain"]["tok_s"]
    print(f"\n== concurrency {args.concurrency}, {PROMPT_LEN} + up to {args.output_len} tokens")
    rows = []
    for name, level in variants.items():
        rows.append(
            [
                name,
                fmt(level["tok_s"]),
                f"{level['tok_s'] / plain:.0%}",
                str(level["output_tokens"] // max(1, level["num_requests"])),
                fmt(level["ttft_median_ms"], 0),
                fmt(level["tpot_median_ms"]),
                str(level["num_errors"]),
            ]
        )
    print_table(
        ["variant", "tok/s", "vs plain", "tokens/request", "TTFT ms", "TPOT ms", "errors"], rows
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vocab = start_benchmark(args.model)
    results = run(args, vocab)
    print_summary(results, args)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
