"""Grammar abuse over HTTP: what costly schemas do to everyone else, one reproduction at a time.

    .venv/bin/python bench/grammar_abuse.py [--model PATH] [--dtype bfloat16]
        [--checkout PATH] [--scenarios NAME,...] [--requests 16] [--max-tokens 40]
        [--json out.json]

One server, run from `--checkout` (a git checkout: its directory goes first on the server's
PYTHONPATH, so this script measures main and a branch alike; default: this one). First,
ordinary 4-token requests and GET /health alone (their latency). Then each scenario in turn:
`--requests` concurrent abusive requests (each distinct, so that no refusal list keyed by
the schema catches them), while a neighbour sends an ordinary 4-token completion every
0.25 s and GET /health every 0.1 s (for `--window` seconds at least). The scenarios are
the hostile-clients probe's reproductions (round three, items 2 and 3):

- space-in-count: `^a{ 100000}$` (regex-syntax reads the spaces; a check that did not);
- repeats-in-sequence: `a{2000}` fifty times (each repeat under the old bound, their sum not);
- answer-beside-tools: `^a{100000}$` as the answer schema of a chat with tools under
  `tool_choice: auto` (embedded in the tools grammar);
- x-guidance-whitespace: a top-level `x-guidance` with `whitespace_pattern: "[ ]{0,100000}"`;
- x-guidance-options: `item_separator` and `lenient` set by the client;
- min-length: `minLength` 100000 and more;
- tool-parameters: `^a{ 100000}$` in a tool's parameters under `tool_choice: required`;
- plain-load: as many ordinary requests of `--max-tokens` tokens, no grammar: the control
  for the next one;
- within-bounds: schemas just inside the engine's bounds (`^a{4000}$`, `minLength` 500
  beside `^a*$`), accepted: what the step's mask budget leaves the neighbours.

Printed per scenario: the abusive requests' status codes (with error code and param), their
wall time, the neighbour's 4-token latency and /health latency (median and worst, and the
worst minus the median alone), the seconds the engine core spent in steps, in grammar masks
and in grammar builds, and the structured rows deferred by the step budget (when the server
has those metrics); then the number of 500s in all. Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
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

PROBE_INTERVAL_S = 0.25
HEALTH_INTERVAL_S = 0.1
SETTLE_S = 2.0  # between scenarios, so that one's tail does not land in the next
WARMUP_REQUESTS = 3  # before the baseline: the first requests of a server are slower
DEFERRED_METRIC = "otel_engine_grammar_deferred_total"
COMPILE_METRIC = "otel_engine_grammar_compile_seconds_sum"
STEP_METRIC = "otel_engine_step_duration_seconds_sum"
# What the server spent during a scenario (absent on a server without the metric: "-").
SERVER_METRICS = {
    STEP_METRIC: "step_s",
    MASK_METRIC: "mask_s",
    COMPILE_METRIC: "compile_s",
    DEFERRED_METRIC: "deferred",
}
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


def _string(pattern: str, **keywords: Any) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern, **keywords}


def _answer(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _completion(schema: dict[str, Any], max_tokens: int) -> tuple[str, dict[str, Any]]:
    body = {"prompt": "Write it:", "max_tokens": max_tokens, "response_format": _answer(schema)}
    return "/v1/completions", body


def _chat(max_tokens: int, **fields: Any) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": "Answer as JSON."}]
    return "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **fields}


def _tool_with(schema: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"q": schema}}
    return {"type": "function", "function": {"name": "search", "parameters": parameters}}


# Each scenario: the i-th abusive request's (path, body) for a `max_tokens`.
Scenario = Callable[[int, int], tuple[str, dict[str, Any]]]
SCENARIOS: dict[str, Scenario] = {
    "space-in-count": lambda i, n: _completion(_string(f"^a{{ {100000 + i}}}$"), n),
    "repeats-in-sequence": lambda i, n: _completion(
        _string("^" + "a{2000}" * 49 + f"a{{{2000 - i}}}$"), n
    ),
    "answer-beside-tools": lambda i, n: _chat(
        n,
        tools=[TOOL],
        tool_choice="auto",
        response_format=_answer(_string(f"^a{{{100000 + i}}}$")),
    ),
    "x-guidance-whitespace": lambda i, n: _completion(
        {"type": "object", "x-guidance": {"whitespace_pattern": f"[ ]{{0,{100000 + i}}}"}}, n
    ),
    "x-guidance-options": lambda i, n: _completion(
        {"type": "object", "x-guidance": {"item_separator": " ," + " " * i, "lenient": True}}, n
    ),
    "min-length": lambda i, n: _completion({"type": "string", "minLength": 100000 + i}, n),
    "tool-parameters": lambda i, n: _chat(
        n, tools=[_tool_with(_string(f"^a{{ {100000 + i}}}$"))], tool_choice="required"
    ),
    "plain-load": lambda i, n: (
        "/v1/completions",
        {"prompt": f"Count to {i}:", "max_tokens": n, "ignore_eos": True},
    ),
    "within-bounds": lambda i, n: _completion(
        _string(f"^a{{{4000 + i}}}$") if i % 2 else _string("^a*$", minLength=500 - i), n
    ),
}


ACCEPTED = {"plain-load", "within-bounds"}  # the scenarios the engine is meant to serve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument(
        "--checkout", type=Path, help="run the server from this git checkout (default: this one)"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--requests", type=int, default=16, help="abusive requests a scenario")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--baseline-probes", type=int, default=10)
    parser.add_argument(
        "--window", type=float, default=3.0, help="seconds the neighbour runs at least"
    )
    args = parser.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    return args


def server_env(checkout: Path | None) -> dict[str, str]:
    """The server's environment: `checkout` first on its path, and not the directory it
    starts in (PYTHONSAFEPATH: `python -m` would put that first)."""
    root = (checkout or Path(__file__).resolve().parents[1]).resolve()
    return {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}


def _described(response: httpx.Response) -> str:
    if response.status_code == 200:
        return "200"
    try:
        error = response.json().get("error", {})
    except ValueError:
        return str(response.status_code)
    return f"{response.status_code} {error.get('code')}/{error.get('param')}"


class Neighbour:
    """An ordinary client beside the abuse: 4-token completions and GET /health, timed."""

    def __init__(self, client: httpx.AsyncClient, model: str) -> None:
        self.client = client
        self.model = model
        self.completions: list[float] = []
        self.health: list[float] = []
        self.statuses: Counter[str] = Counter()

    async def completion(self) -> float:
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        started = time.perf_counter()
        response = await self.client.post("/v1/completions", json=body)
        self.statuses[_described(response)] += 1
        return time.perf_counter() - started

    async def health_check(self) -> float:
        started = time.perf_counter()
        response = await self.client.get("/health")
        self.statuses[f"health {response.status_code}"] += 1
        return time.perf_counter() - started

    async def run(self, done: asyncio.Event) -> None:
        async def completions() -> None:
            while not done.is_set():
                self.completions.append(await self.completion())
                await asyncio.sleep(PROBE_INTERVAL_S)

        async def health() -> None:
            while not done.is_set():
                self.health.append(await self.health_check())
                await asyncio.sleep(HEALTH_INTERVAL_S)

        await asyncio.gather(completions(), health())


async def _baseline(client: httpx.AsyncClient, model: str, num: int) -> dict[str, Any]:
    alone = Neighbour(client, model)
    for _ in range(WARMUP_REQUESTS):
        await alone.completion()
    for _ in range(num):
        alone.completions.append(await alone.completion())
        alone.health.append(await alone.health_check())
    return {
        "completion_median_ms": _ms(quantile(alone.completions, 0.5)),
        "health_median_ms": _ms(quantile(alone.health, 0.5)),
    }


async def _scenario(
    client: httpx.AsyncClient, model: str, scenario: Scenario, args: argparse.Namespace
) -> dict[str, Any]:
    neighbour = Neighbour(client, model)
    done = asyncio.Event()
    beside = asyncio.create_task(neighbour.run(done))

    async def abuse(index: int) -> str:
        path, body = scenario(index, args.max_tokens)
        response = await client.post(path, json={"model": model, **body})
        return _described(response)

    started = time.perf_counter()
    answers = await asyncio.gather(*(abuse(i) for i in range(args.requests)))
    batch_s = time.perf_counter() - started
    await asyncio.sleep(max(0.0, args.window - batch_s))
    done.set()
    await beside
    return {
        "statuses": dict(Counter(answers)),
        "batch_s": round(batch_s, 2),
        "neighbour_statuses": dict(neighbour.statuses),
        "num_completions": len(neighbour.completions),
        "completion_median_ms": _ms(quantile(neighbour.completions, 0.5)),
        "completion_max_ms": _ms(max(neighbour.completions, default=None)),
        "health_median_ms": _ms(quantile(neighbour.health, 0.5)),
        "health_max_ms": _ms(max(neighbour.health, default=None)),
    }


async def _measure(base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"scenarios": {}}
    async with httpx.AsyncClient(base_url=base_url, timeout=900.0, trust_env=False) as client:
        results["alone"] = await _baseline(client, model, args.baseline_probes)
        for name in args.scenarios.split(","):
            before = {metric: _metric(base_url, metric) for metric in SERVER_METRICS}
            result = await _scenario(client, model, SCENARIOS[name], args)
            for metric, key in SERVER_METRICS.items():
                result[key] = _delta(_metric(base_url, metric), before[metric])
            results["scenarios"][name] = result
            print(f"{name}: {result['statuses']} in {result['batch_s']} s", flush=True)
            await asyncio.sleep(SETTLE_S)
    return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    env = server_env(args.checkout)
    server = ServerProcess(flags, free_port(), env=env)
    results: dict[str, Any] = {"server_pythonpath": env["PYTHONPATH"]}
    try:
        results["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        model = served_model_name(server.base_url)
        results.update(asyncio.run(_measure(server.base_url, model, args)))
    finally:
        results["shutdown"] = server.stop()
    return results


def print_summary(results: dict[str, Any], args: argparse.Namespace) -> None:
    alone = results["alone"]
    print(f"\n== server from {results['server_pythonpath']}; {args.requests} requests a scenario")
    print(
        f"alone: 4-token {fmt(alone['completion_median_ms'])} ms, "
        f"/health {fmt(alone['health_median_ms'])} ms (medians)"
    )
    rows = []
    num_500 = 0
    for name, result in results["scenarios"].items():
        statuses = result["statuses"]
        num_500 += sum(n for status, n in statuses.items() if status.startswith("500"))
        num_500 += sum(
            n for status, n in result["neighbour_statuses"].items() if status.startswith("500")
        )
        rows.append(
            [
                name,
                " ".join(f"{n}x{status}" for status, n in sorted(statuses.items())),
                fmt(result["batch_s"], 2),
                f"{fmt(result['completion_median_ms'])}/{fmt(result['completion_max_ms'])}",
                fmt(_minus(result["completion_max_ms"], alone["completion_median_ms"])),
                f"{fmt(result['health_median_ms'])}/{fmt(result['health_max_ms'])}",
                fmt(_minus(result["health_max_ms"], alone["health_median_ms"])),
                fmt(result["step_s"], 2),
                fmt(result["mask_s"], 2),
                fmt(result["compile_s"], 2),
                fmt(result["deferred"], 0),
            ]
        )
    print_table(
        [
            "scenario",
            "abusive requests",
            "wall s",
            "4-token med/max ms",
            "+worst ms",
            "/health med/max ms",
            "+worst ms",
            "steps s",
            "masks s",
            "compiles s",
            "deferred",
        ],
        rows,
    )
    print(f"responses with status 500: {num_500}")


def _metric(base_url: str, name: str) -> float | None:
    try:
        return metric_sum(base_url, name)
    except httpx.HTTPError:
        return None


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None else after - (before or 0.0)


def _minus(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else round(value - base, 1)


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
