"""otel-engine: an LLM serving engine whose failures are observable and clean.

The public names load on first use (PEP 562), so that a process importing one module of the
package (a worker importing `otel_engine.errors`) does not load the whole engine with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from otel_engine.version import __version__

if TYPE_CHECKING:
    from otel_engine.engine.async_llm import AsyncLLM as AsyncLLM
    from otel_engine.engine.llm import LLM as LLM
    from otel_engine.errors import EngineDeadError as EngineDeadError
    from otel_engine.errors import EngineStartupError as EngineStartupError
    from otel_engine.errors import RequestError as RequestError
    from otel_engine.outputs import CompletionOutput as CompletionOutput
    from otel_engine.outputs import RequestOutput as RequestOutput
    from otel_engine.sampling_params import SamplingParams as SamplingParams

_PUBLIC = {
    "LLM": "otel_engine.engine.llm",
    "AsyncLLM": "otel_engine.engine.async_llm",
    "CompletionOutput": "otel_engine.outputs",
    "EngineDeadError": "otel_engine.errors",
    "EngineStartupError": "otel_engine.errors",
    "RequestError": "otel_engine.errors",
    "RequestOutput": "otel_engine.outputs",
    "SamplingParams": "otel_engine.sampling_params",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineDeadError",
    "EngineStartupError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
