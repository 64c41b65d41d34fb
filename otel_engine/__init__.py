"""otel-engine: an LLM serving engine whose failures are observable and clean."""

from otel_engine.engine.async_llm import AsyncLLM
from otel_engine.engine.llm import LLM
from otel_engine.errors import EngineDeadError, EngineStartupError, RequestError
from otel_engine.outputs import CompletionOutput, RequestOutput
from otel_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineDeadError",
    "EngineStartupError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
