"""`make fuzz`: a bounded, seeded schemathesis run (under 2 minutes) against a real server.

Starts `otel-engine serve` on the tiny test model (written to a temporary directory) with an
API key, runs every schemathesis phase against the server's own OpenAPI document, prints the
report, then searches with hypothesis for 5xx over hostile `logit_bias`, `response_format`
schemas and numbers (`search_server_errors`), and exits 0 only when both found nothing (no
5xx, every answer as documented). The test suite runs shorter versions
(tests/entrypoints/test_openapi.py, tests/entrypoints/test_fuzz_requests.py).

    .venv/bin/python -m tests.fuzz_api [--seed N] [--max-examples N] [--max-time S]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.helpers.fuzz import run_schemathesis, search_server_errors
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import write_tiny_llama

API_KEY = "fuzz-key"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--max-examples", type=int, default=60)
    parser.add_argument("--max-time", type=float, default=90.0, help="seconds of fuzzing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="otel-engine-fuzz-") as scratch:
        model_dir = write_tiny_llama(Path(scratch) / "tiny")
        with ServerProcess(["--model", model_dir, "--api-key", API_KEY]) as server:
            server.wait_healthy()
            result = run_schemathesis(
                server.base_url,
                max_examples=args.max_examples,
                seed=args.seed,
                max_time_s=args.max_time,
                headers={"Authorization": f"Bearer {API_KEY}"},
            )
            print(result.stdout)
            print(result.stderr, file=sys.stderr)
            searched = _search(server.base_url, args.seed, args.max_examples * 5)
            if server.returncode is not None:
                print(f"the server exited with {server.returncode}:\n{server.tail()}")
                return 1
    return result.returncode or searched


def _search(base_url: str, seed: int, max_examples: int) -> int:
    """The hypothesis phase; 1 (with the smallest failing request printed) on a 5xx."""
    try:
        search_server_errors(
            base_url,
            max_examples=max_examples,
            seed=seed,
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    except AssertionError as error:
        print(f"hypothesis found a server error: {error}")
        return 1
    print(f"hypothesis: {max_examples} hostile requests, no server error")
    return 0


if __name__ == "__main__":
    sys.exit(main())
