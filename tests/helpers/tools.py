"""Programs some tests need from the machine (Debian's prometheus and promtool).

Where they are missing the test is skipped, except in CI: `.ci/run` installs them and sets
OTEL_ENGINE_REQUIRE_PROMETHEUS, so a missing one fails there instead of skipping silently.
"""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRE_ENV = "OTEL_ENGINE_REQUIRE_PROMETHEUS"


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`; skip (fail in CI) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{name} is missing but {REQUIRE_ENV} is set (CI installs it)")
        pytest.skip(f"{name} is not installed (Debian package prometheus; .ci/run installs it)")
    return path
