"""Where otel-engine keeps what it builds once and reuses: `$OTEL_ENGINE_CACHE_DIR`, else
`~/.cache/otel-engine` (converted GGUF checkpoints, `model/gguf.py`; compiled CPU kernels,
under `kernels/`, `model/kernels.py`; the memory read bandwidth measured per CPU and thread
count, under `bandwidth/`, `model/bandwidth.py`)."""

from __future__ import annotations

import os

CACHE_DIR_ENV = "OTEL_ENGINE_CACHE_DIR"


def cache_root() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.expanduser("~/.cache/otel-engine")
