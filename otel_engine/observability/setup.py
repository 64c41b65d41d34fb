"""Per-process telemetry set-up: the main process decides, children read the environment.

`setup_main_process(config)` (api_server, CLI) configures logging and tracing for this
process. Every child is spawned with `spawn_env(config)`: this process's environment plus the
observability settings of its engine as `OTEL_ENGINE_*` variables (nothing is written to
`os.environ`, so two engines in one process keep their own settings); the spawn trampoline
calls `setup_process(role=..., rank=...)`, which reads them back, and configures the fault
injector. The standard `OTEL_*` variables travel the same way and are read by the
OpenTelemetry SDK in every process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from otel_engine.config import EngineConfig, ObservabilityConfig
from otel_engine.observability import faults
from otel_engine.observability.logging import configure_logging
from otel_engine.observability.tracing import configure_tracing

ENV_LOG_FORMAT = "OTEL_ENGINE_LOG_FORMAT"
ENV_LOG_LEVEL = "OTEL_ENGINE_LOG_LEVEL"
ENV_LOG_PROMPTS = "OTEL_ENGINE_LOG_PROMPTS"
ENV_OTLP_ENDPOINT = "OTEL_ENGINE_OTLP_ENDPOINT"
ENV_OTLP_PROTOCOL = "OTEL_ENGINE_OTLP_PROTOCOL"
ENV_OTLP_LOGS = "OTEL_ENGINE_OTLP_LOGS"
ENV_INSTANCE_ID = "OTEL_ENGINE_INSTANCE_ID"
_TRUE = ("1", "true", "yes", "on")


def child_env(config: EngineConfig) -> dict[str, str]:
    """The `OTEL_ENGINE_*` variables that tell children how to log and export."""
    obs = config.observability
    env = {
        ENV_LOG_FORMAT: obs.log_format,
        ENV_LOG_LEVEL: obs.log_level.upper(),
        ENV_LOG_PROMPTS: "1" if obs.log_prompts else "0",
        ENV_OTLP_LOGS: "1" if obs.otlp_logs else "0",
        ENV_INSTANCE_ID: config.instance_id,
    }
    if obs.otlp_endpoint:
        env[ENV_OTLP_ENDPOINT] = obs.otlp_endpoint
    if obs.otlp_protocol:
        env[ENV_OTLP_PROTOCOL] = obs.otlp_protocol
    return env


def spawn_env(config: EngineConfig) -> dict[str, str]:
    """The whole environment of a child of this engine: this process's, with the engine's
    `child_env` over it (an OTLP endpoint this engine does not set is not inherited)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_OTLP_ENDPOINT, ENV_OTLP_PROTOCOL)}
    env.update(child_env(config))
    return env


def config_from_env(
    level: str | None = None, environ: Mapping[str, str] | None = None
) -> ObservabilityConfig:
    """The observability settings a parent passed down (defaults where it set none)."""
    env = os.environ if environ is None else environ
    defaults = ObservabilityConfig()
    return ObservabilityConfig(
        otlp_endpoint=env.get(ENV_OTLP_ENDPOINT) or None,
        otlp_protocol=env.get(ENV_OTLP_PROTOCOL) or None,
        otlp_logs=env.get(ENV_OTLP_LOGS, "0").strip().lower() in _TRUE,
        log_format=env.get(ENV_LOG_FORMAT) or defaults.log_format,
        log_level=(level or env.get(ENV_LOG_LEVEL) or defaults.log_level).upper(),
        log_prompts=env.get(ENV_LOG_PROMPTS, "0").strip().lower() in _TRUE,
    )


def configure(
    *, role: str, rank: int | None, config: ObservabilityConfig, instance_id: str | None
) -> bool:
    """Logging first (so tracing set-up can log), then tracing; True if spans are exported."""
    configure_logging(
        role=role,
        rank=rank,
        fmt=config.log_format,
        level=config.log_level,
        log_prompts=config.log_prompts,
    )
    return configure_tracing(role=role, rank=rank, config=config, instance_id=instance_id)


def setup_process(*, role: str, rank: int | None = None, level: str | None = None) -> bool:
    """Configure a child process from the `OTEL_ENGINE_*` variables its parent passed, and
    its fault injector from `OTEL_ENGINE_FAULT` (a bad value fails the child's startup)."""
    faults.configure()
    return configure(
        role=role,
        rank=rank,
        config=config_from_env(level),
        instance_id=os.environ.get(ENV_INSTANCE_ID),
    )


def setup_main_process(config: EngineConfig, *, role: str = "api_server") -> bool:
    """Configure this process's logging and tracing from `config`."""
    return configure(
        role=role, rank=None, config=config.observability, instance_id=config.instance_id
    )
