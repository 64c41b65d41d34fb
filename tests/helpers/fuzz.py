"""Schemathesis against a running server's own OpenAPI document: no 5xx, and every answer
(status, content type, headers, body) as the document says."""

from __future__ import annotations

import subprocess
import sys

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)


def run_schemathesis(
    base_url: str,
    *,
    max_examples: int,
    seed: int,
    phases: str = "examples,coverage,fuzzing",
    max_time_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`st run` in a subprocess (one worker, seeded); returns its result with the report."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        phases,
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    if max_time_s is not None:
        command += ["--max-time", str(int(max_time_s))]
    for name, value in (headers or {}).items():
        command += ["--header", f"{name}: {value}"]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
