"""Fixtures for the telemetry tests: a clean environment and Python subprocesses.

Tracer providers are global and set once per process, so everything that installs one
runs in a fresh interpreter started from the repository root, with every inherited
`OTEL_*` variable removed first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers.paths import REPO_ROOT

RunPython = Callable[..., subprocess.CompletedProcess[str]]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without OTEL_* variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every non-empty line parsed as a JSON object (fails on any other line)."""
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert all(isinstance(record, dict) for record in records)
    return records


@pytest.fixture(scope="session")
def run_python() -> RunPython:
    """Run `code` in a new interpreter at the repository root; returns the finished process."""

    def run(code: str, env: dict[str, str] | None = None, timeout: float = 120):
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO_ROOT,
            env=clean_env(**(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    return run
