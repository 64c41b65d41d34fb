"""The processes of an engine, by role."""

from __future__ import annotations

import enum


class ProcessRole(enum.StrEnum):
    """What a process is: its `role` in logs and telemetry resources, the place a fault is
    injected (`OTEL_ENGINE_FAULT=<role>:...`), its title (`ipc.process.process_title`), and
    the engine core's name in failure reports."""

    API_SERVER = "api_server"  # the front end: the HTTP server, or the process calling `LLM`
    ENGINE_CORE = "engine_core"
    WORKER = "worker"  # a tensor-parallel rank
