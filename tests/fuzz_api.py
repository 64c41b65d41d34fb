"""`make fuzz`: a bounded, seeded schemathesis run against a real server, then a hypothesis
search for 5xx over hostile bodies, on the tiny model with each tool format.

For each of `--formats` (`generic`: the tiny model, whose template teaches no tool format;
`hermes`: the tiny model with Qwen2.5's tool markup), starts `otel-engine serve` with an API
key, runs every schemathesis phase against the server's own OpenAPI document and prints the
report, then posts `--bodies` hostile bodies in all (split evenly between the formats and
three hypothesis searches: hostile `logit_bias`, `response_format` schemas and numbers;
earlier tool calls and Responses items a client got wrong; bodies drawn from the document's
request schemas with a hostile value put inside). Prints the bodies posted, their status
codes and the 500s; exits 0 only when nothing found a 5xx (and every schemathesis answer was
as documented). The test suite runs shorter versions (tests/entrypoints/test_openapi.py,
tests/entrypoints/test_fuzz_requests.py).

    .venv/bin/python -m tests.fuzz_api [--seed N] [--max-examples N] [--max-time S]
        [--bodies N] [--formats generic,hermes]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.fuzz import (
    history_cases,
    request_cases,
    run_schemathesis,
    schema_cases,
    search_server_errors,
)
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import write_tiny_llama, write_tiny_tool_model

API_KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--max-examples", type=int, default=60, help="schemathesis, per route")
    parser.add_argument("--max-time", type=float, default=90.0, help="seconds of schemathesis")
    parser.add_argument("--bodies", type=int, default=1500, help="hypothesis bodies in all")
    parser.add_argument("--formats", default="generic,hermes")
    args = parser.parse_args()
    formats = args.formats.split(",")
    failed = 0
    totals: Counter[int] = Counter()
    with tempfile.TemporaryDirectory(prefix="otel-engine-fuzz-") as scratch:
        for kind in formats:
            model_dir = Path(scratch) / kind
            model = (
                write_tiny_tool_model(model_dir)
                if kind == "hermes"
                else write_tiny_llama(model_dir)
            )
            with ServerProcess(["--model", model, "--api-key", API_KEY]) as server:
                server.wait_healthy()
                result = run_schemathesis(
                    server.base_url,
                    max_examples=args.max_examples,
                    seed=args.seed,
                    max_time_s=args.max_time,
                    headers=HEADERS,
                )
                print(f"== schemathesis, {kind}")
                print(result.stdout[-3000:])
                print(result.stderr[-2000:], file=sys.stderr)
                failed |= result.returncode
                per_search = args.bodies // (3 * len(formats))
                failed |= _search(server.base_url, kind, args.seed, per_search, totals)
                if server.returncode is not None:
                    print(f"the server exited with {server.returncode}:\n{server.tail()}")
                    return 1
    print(f"== hypothesis in all: {sum(totals.values())} bodies, statuses {dict(totals)}")
    print(f"   500s: {totals[500]}, 5xx: {sum(n for s, n in totals.items() if s >= 500)}")
    return 1 if failed else 0


def _search(base_url: str, kind: str, seed: int, max_examples: int, totals: Counter[int]) -> int:
    """The hypothesis searches against one server; 1 (with the smallest failing request
    printed) on a 5xx."""
    openapi = httpx.get(f"{base_url}/openapi.json", headers=HEADERS, trust_env=False).json()
    searches: dict[str, Any] = {
        "request_cases": request_cases(),
        "history_cases": history_cases(),
        "schema_cases": schema_cases(openapi),
    }
    failed = 0
    for name, cases in searches.items():
        statuses: Counter[int] = Counter()
        try:
            search_server_errors(
                base_url,
                max_examples=max_examples,
                seed=seed,
                headers=HEADERS,
                cases=cases,
                statuses=statuses,
            )
            verdict = "no server error"
        except AssertionError as error:
            verdict = f"SERVER ERROR: {error}"
            failed = 1
        totals.update(statuses)
        print(f"hypothesis {kind} {name}: {sum(statuses.values())} bodies, {dict(statuses)}")
        print(f"   {verdict}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
