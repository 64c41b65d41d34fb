"""Process set-up: each engine passes its settings to the children it spawns (never through
`os.environ`), and they follow them; the fault injector is configured at set-up, not import."""

from __future__ import annotations

import dataclasses
import json

import pytest

from otel_engine.config import EngineConfig
from otel_engine.observability.setup import child_env, config_from_env, spawn_env
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.observability.conftest import RunPython, json_lines

pytestmark = pytest.mark.slow  # starts servers or engine processes

PARENT_SCRIPT = """
import json, logging, time
from otel_engine.config import EngineConfig
from otel_engine.ipc.process import spawn
from otel_engine.observability.setup import setup_main_process, spawn_env
from otel_engine.observability.tracing import get_tracer, inject_context, shutdown_telemetry

config = EngineConfig.from_kwargs(otlp_endpoint="{endpoint}", otlp_protocol="grpc")
setup_main_process(config)
with get_tracer().start_as_current_span("request") as span:
    child = spawn("tests.observability.targets:traced_child",
                  inject_context(), role="worker", rank=0, env=spawn_env(config))
    child.wait_ready(time.monotonic() + 60)
    child.join(60)
    logging.getLogger("otel_engine.api_server").info("parent.done")
child.stop(5)
child.close()
print(json.dumps({{"instance_id": config.instance_id, "exitcode": child.exitcode,
                   "trace_id": format(span.get_span_context().trace_id, "032x")}}), flush=True)
assert shutdown_telemetry(10)
"""


@pytest.fixture(scope="module")
def parent_and_child(run_python: RunPython):
    """A main process that spawns one worker through the real trampoline, inside a span."""
    with OtlpReceiver("grpc") as receiver:
        done = run_python(PARENT_SCRIPT.format(endpoint=receiver.endpoint))
        assert 0 == done.returncode, done.stderr
        spans = receiver.wait_for(lambda r: len(r.spans()) >= 2 and r.spans())
    return json.loads(done.stdout), json_lines(done.stderr), spans


def test_child_span_joins_the_parent_trace(parent_and_child) -> None:
    """The worker's span is a child of the api_server's span, across the process boundary."""
    info, _, spans = parent_and_child
    by_name = {span["name"]: span for span in spans}
    parent, child = by_name["request"], by_name["child.work"]
    assert 0 == info["exitcode"]
    assert info["trace_id"] == parent["trace_id"] == child["trace_id"]
    assert parent["span_id"] == child["parent_span_id"]


def test_each_process_has_its_own_resource(parent_and_child) -> None:
    """Both processes share the engine instance id; role, rank and pid are their own."""
    info, _, spans = parent_and_child
    resources = {span["name"]: span["resource"] for span in spans}
    parent, child = resources["request"], resources["child.work"]
    assert info["instance_id"] == parent["service.instance.id"] == child["service.instance.id"]
    assert ("api_server", "worker", 0) == (
        parent["otel_engine.process.role"],
        child["otel_engine.process.role"],
        child["otel_engine.worker.rank"],
    )
    assert "otel_engine.worker.rank" not in parent
    assert parent["process.pid"] != child["process.pid"]


def test_all_processes_log_json_to_one_stream(parent_and_child) -> None:
    """The child's lines reach the parent's stderr as JSON with its role, rank and trace id."""
    info, records, _ = parent_and_child
    child_line = next(r for r in records if r["event"] == "child.working")
    parent_line = next(r for r in records if r["event"] == "parent.done")
    assert ("worker", 0, 2) == (child_line["role"], child_line["rank"], child_line["num_items"])
    assert info["trace_id"] == child_line["trace_id"] == parent_line["trace_id"]
    assert "api_server" == parent_line["role"]
    assert child_line["pid"] != parent_line["pid"]


@pytest.fixture
def child_env_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every OTEL_ENGINE_* variable a test exports is put back as it was afterwards."""
    full = EngineConfig.from_kwargs(otlp_endpoint="x", otlp_protocol="grpc")
    for name in child_env(full):
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)


def test_child_env_round_trips(child_env_restored: None) -> None:
    """What an engine passes to its children is what a child reads back."""
    config = EngineConfig.from_kwargs(
        otlp_endpoint="http://collector:4318",
        otlp_protocol="http/protobuf",
        otlp_logs=True,
        log_format="console",
        log_level="debug",
        log_prompts=True,
    )
    environ = spawn_env(config)
    expected = dataclasses.replace(config.observability, log_level="DEBUG")
    assert expected == config_from_env(environ=environ)


def test_every_observability_setting_has_one_way_to_a_child() -> None:
    """Issue 24: each ObservabilityConfig field either travels in the environment (both
    directions derived from one table) or only inside the EngineConfig; a new field fails
    here until it is given one."""
    from otel_engine.config import ObservabilityConfig
    from otel_engine.observability.setup import CARRIED_FIELDS, CONFIG_ONLY_FIELDS

    names = [f.name for f in dataclasses.fields(ObservabilityConfig)]
    assert sorted(names) == sorted([*CARRIED_FIELDS, *CONFIG_ONLY_FIELDS])
    assert not set(CARRIED_FIELDS) & set(CONFIG_ONLY_FIELDS)


def test_cleared_endpoint_is_not_inherited(
    child_env_restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine without an endpoint does not pass on one found in this process's
    environment."""
    monkeypatch.setenv("OTEL_ENGINE_OTLP_ENDPOINT", "http://old:4317")
    assert config_from_env(environ=spawn_env(EngineConfig())).otlp_endpoint is None


def test_level_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """setup_process(level=...) (the old signature) overrides the exported level."""
    monkeypatch.setenv("OTEL_ENGINE_LOG_LEVEL", "INFO")
    assert "WARNING" == config_from_env("warning").log_level


def test_engines_leave_the_process_environment_alone(
    tiny_model_dir: str, child_env_restored: None
) -> None:
    """Two engines in one process with different settings: os.environ is untouched (each
    passes its own settings to the children it spawns, `spawn_env`)."""
    import os

    from otel_engine import LLM

    before = dict(os.environ)
    first = LLM(tiny_model_dir, multiprocess=True, log_format="json", num_kv_blocks=64)
    second = LLM(tiny_model_dir, multiprocess=True, log_format="console", num_kv_blocks=64)
    try:
        assert before == dict(os.environ)
        assert "json" == spawn_env(first.config)["OTEL_ENGINE_LOG_FORMAT"]
        assert "console" == spawn_env(second.config)["OTEL_ENGINE_LOG_FORMAT"]
    finally:
        first.shutdown()
        second.shutdown()


def test_a_bad_fault_spec_fails_set_up_not_import(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, run_python: RunPython
) -> None:
    """A malformed OTEL_ENGINE_FAULT does not break importing the package; an engine set
    up with it fails with an error naming the variable."""
    from otel_engine import LLM

    imported = run_python(
        "import otel_engine, otel_engine.observability.faults; print('ok')",
        env={"OTEL_ENGINE_FAULT": "gpu:melt"},
    )
    assert "ok" in imported.stdout, imported.stderr
    monkeypatch.setenv("OTEL_ENGINE_FAULT", "gpu:melt")

    with pytest.raises(ValueError, match="OTEL_ENGINE_FAULT"):
        LLM(tiny_model_dir)
