"""`make fuzz`: a bounded, seeded schemathesis run (under 2 minutes) against a real server.

Starts `otel-engine serve` on the tiny test model (written to a temporary directory) with an
API key, runs every schemathesis phase against the server's own OpenAPI document, prints the
report and exits with schemathesis' code (0: no 5xx, every answer as documented). The test
suite runs a shorter version (tests/entrypoints/test_openapi.py).

    .venv/bin/python -m tests.fuzz_api [--seed N] [--max-examples N] [--max-time S]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.helpers.fuzz import run_schemathesis
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
            if server.returncode is not None:
                print(f"the server exited with {server.returncode}:\n{server.tail()}")
                return 1
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
