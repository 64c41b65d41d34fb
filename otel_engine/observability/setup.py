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
from otel_engine.ipc.roles import ProcessRole
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


# The observability settings a child reads from its environment, by `ObservabilityConfig`
# field: it sets up logging and exporters first thing, before it decodes its `EngineConfig`
# (so that a failure to decode it is logged as configured). Both directions (`child_env`,
# `config_from_env`) are derived from this table; the rest of the config (crash dumps)
# travels inside the `EngineConfig` only.
CARRIED_FIELDS = {
    "log_format": ENV_LOG_FORMAT,
    "log_level": ENV_LOG_LEVEL,
    "log_prompts": ENV_LOG_PROMPTS,
    "otlp_endpoint": ENV_OTLP_ENDPOINT,
    "otlp_protocol": ENV_OTLP_PROTOCOL,
    "otlp_logs": ENV_OTLP_LOGS,
}
# Read by the engine core from its EngineConfig, never from the environment.
CONFIG_ONLY_FIELDS = ("crash_history_steps", "crash_dump_dir")


def child_env(config: EngineConfig) -> dict[str, str]:
    """The `OTEL_ENGINE_*` variables that tell children how to log and export."""
    env = {ENV_INSTANCE_ID: config.instance_id}
    for name, variable in CARRIED_FIELDS.items():
        value = getattr(config.observability, name)
        if isinstance(value, bool):
            env[variable] = "1" if value else "0"
        elif value:
            env[variable] = value.upper() if name == "log_level" else str(value)
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
    values: dict[str, object] = {}
    for name, variable in CARRIED_FIELDS.items():
        raw, default = env.get(variable), getattr(defaults, name)
        if isinstance(default, bool):
            values[name] = (raw or "0").strip().lower() in _TRUE
        else:
            values[name] = raw or default
    values["log_level"] = str(level or values["log_level"]).upper()
    return ObservabilityConfig(**values)  # type: ignore[arg-type]


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


def setup_main_process(config: EngineConfig, *, role: str = ProcessRole.API_SERVER) -> bool:
    """Configure this process's logging and tracing from `config`."""
    return configure(
        role=role, rank=None, config=config.observability, instance_id=config.instance_id
    )
