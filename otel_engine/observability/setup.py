"""Per-process telemetry set-up, called by the spawn trampoline and the api_server."""

from __future__ import annotations

import logging
import os
import sys


def setup_process(*, role: str, rank: int | None = None, level: str | None = None) -> None:
    """Configure logging for this process (JSON logs and tracing come with telemetry)."""
    level_name = level or os.environ.get("OTEL_ENGINE_LOG_LEVEL", "INFO")
    tag = role if rank is None else f"{role}-{rank}"
    logging.basicConfig(
        level=level_name,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s",
        force=True,
    )
