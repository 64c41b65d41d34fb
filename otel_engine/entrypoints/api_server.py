"""The OpenAI-compatible HTTP server, wired from the edge's rooms: the network room's server
(network/server.py: uvicorn, drain, exit on engine death) runs the OpenAI surface's app
(openai/app.py), and both share one `ServerState` (network/guard.py).

The engine is created before the server (so the port opens only when the engine is ready)
and is owned by the caller; the app only uses it. `/metrics` serves the `EngineMetrics`
registry, which `run_server` also exports over OTLP when an endpoint is configured.
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import TYPE_CHECKING

from otel_engine.entrypoints.network.guard import ServerState
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.entrypoints.network.server import ApiServer, fit_connection_limit
from otel_engine.entrypoints.openai.app import build_app
from otel_engine.ipc.roles import ProcessRole
from otel_engine.observability.metrics import EngineMetrics
from otel_engine.observability.otlp_export import on_export_failure
from otel_engine.observability.otlp_metrics import start_otlp_metrics

if TYPE_CHECKING:
    from otel_engine import AsyncLLM


def make_server(
    engine: AsyncLLM,
    *,
    api_key: str | None = None,
    drain_timeout: float | None = None,
    exit_on_engine_death: bool = True,
    final_scrape_wait: float = 0.0,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    tool_call_parser: str = "auto",
    vllm_metric_names: bool = False,
) -> ApiServer:
    """An `ApiServer` for `engine`, ready to `run(sockets=[bind_socket(...)])`
    (network/server.py).

    With `exit_on_engine_death=False` the server stays up answering 503 after the engine
    died (an embedding host program decides what to do); `exit_code` is 1 either way.
    """
    metrics = EngineMetrics(
        model_name=engine.model_name, process_metrics=True, vllm_names=vllm_metric_names
    )
    metrics.set_fast_paths(engine.fast_paths)
    metrics.set_memory_bandwidth(engine.memory_bandwidth)
    method = engine.config.speculative.speculative_method
    if method is not None:
        metrics.spec.bind(method)
    cache = engine.config.cache
    metrics.set_cache_config(
        block_size=cache.block_size,
        num_blocks=engine.num_kv_blocks,
        prefix_caching=cache.enable_prefix_caching,
    )
    on_export_failure(metrics.on_export_failure)
    limits = limits or ServerLimits()
    state = ServerState(engine=engine, api_key=api_key, limits=limits, metrics=metrics)
    app = build_app(
        state,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        tool_call_parser=tool_call_parser,
    )
    timeout = engine.config.timeouts.shutdown_timeout if drain_timeout is None else drain_timeout
    return ApiServer(
        app,
        state,
        drain_timeout=timeout,
        exit_on_engine_death=exit_on_engine_death,
        final_scrape_wait=final_scrape_wait,
    )


def run_server(
    engine: AsyncLLM,
    sock: socket.socket,
    *,
    api_key: str | None = None,
    final_scrape_wait: float = 0.0,
    limits: ServerLimits | None = None,
    allow_special_tokens_in_content: bool = False,
    tool_call_parser: str = "auto",
    vllm_metric_names: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the engine dies (exit code 1)."""
    limits = fit_connection_limit(limits or ServerLimits())
    server = make_server(
        engine,
        api_key=api_key,
        final_scrape_wait=final_scrape_wait,
        limits=limits,
        allow_special_tokens_in_content=allow_special_tokens_in_content,
        tool_call_parser=tool_call_parser,
        vllm_metric_names=vllm_metric_names,
    )
    start_otlp_metrics(
        server.state.metrics.otlp_registry,
        config=engine.config.observability,
        role=ProcessRole.API_SERVER,
        instance_id=engine.config.instance_id,
    )
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal it caught once it has shut down; make that a no-op so
        # that the caller can still shut the engine down and exit with the right code.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return server.exit_code
