"""Crash-dump delivery from real engine processes to a real OTLP receiver and to stderr.

Each fatal path runs in its own interpreter (`run_scenario`, the driver below): an
`AsyncLLM` whose processes log JSON to one inherited, captured stderr and export spans and
log records over OTLP/gRPC to a test receiver; three requests are in flight, with canary
strings in their prompts and stop strings, when the fault hits after a few generated
tokens. The paths: a worker raising and a worker SIGKILLed from outside at TP=2 (held by a
`hang` fault at the same step first, so the requests cannot finish before the kill), a hung
worker at TP=2 (the executor's step deadline) and at TP=1 (the engine core's StepWatchdog
thread, the model being in the core), the engine core raising, an OOM-like error. The
generated text the client saw before the crash is itself a canary. The scenarios run side
by side (one module fixture) so the file stays fast on two cores; each test then reads what
one scenario left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest

from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.paths import REPO_ROOT
from tests.helpers.procs import assert_no_children, children_of, is_alive
from tests.observability.conftest import clean_env

pytestmark = pytest.mark.slow  # starts servers or engine processes

PROMPT_CANARY = "zq7-PROMPT-CANARY-4f1e"
STOP_CANARY = "zq7-STOP-CANARY-9b2c"
STOP_ID_CANARY = 511  # dumps say how many stop token ids a request has, never which
PROMPTS = [
    f"{PROMPT_CANARY} the engine schedules requests in steps",
    f"Once upon a time {PROMPT_CANARY} there was a small town",
    f"A quick brown fox jumps over the lazy dog {PROMPT_CANARY}",
]
FAULT_STEP = 8  # requests join within a step or two; each has tokens before the fault
MIN_GENERATED_TOKENS = 4
MAX_TOKENS = 300  # requests are still in flight when the fault hits
RUN_TIMEOUT_S = 80.0
TOKEN_WINDOW = 6  # a run of this many prompt token ids must never appear


@dataclass(frozen=True)
class Scenario:
    """One fatal path and what the crash dump must say about it."""

    name: str
    tp: int
    fault: str | None  # OTEL_ENGINE_FAULT for the engine's processes
    kill: str | None  # title of the process the driver SIGKILLs from outside
    log_level: str
    failure_type: str
    failed_processes: tuple[str, ...]
    failed_rank: int | None
    how: str
    step_timeout: float = 60.0


SCENARIOS = [
    Scenario(
        "worker-raise-tp2", 2, f"worker:raise:rank=1:step={FAULT_STEP}", None, "DEBUG",
        "InjectedFault", ("otel-worker-1",), 1, "exception",
    ),
    Scenario(
        "worker-sigkill-tp2", 2, f"worker:hang:rank=1:step={FAULT_STEP}", "otel-worker-1", "INFO",
        "WorkerDied", ("otel-worker-1",), 1, "died",
    ),
    Scenario(
        "step-timeout-tp2", 2, f"worker:hang:rank=1:step={FAULT_STEP}", None, "INFO",
        "StepTimeout", ("otel-worker-1",), 1, "timeout", step_timeout=3.0,  # the hung rank
    ),
    Scenario(
        "watchdog-timeout", 1, f"worker:hang:step={FAULT_STEP}", None, "DEBUG",
        "StepTimeout", ("engine_core",), None, "timeout", step_timeout=3.0,
    ),
    Scenario(
        "engine-core-raise", 1, f"engine_core:raise:step={FAULT_STEP}", None, "INFO",
        "InjectedFault", ("engine_core",), None, "exception",
    ),
    Scenario(
        "worker-oom", 1, f"worker:oom:step={FAULT_STEP}", None, "DEBUG",
        "InjectedOutOfMemoryError", ("engine_core",), None, "exception",
    ),
]  # fmt: skip
BY_NAME = {s.name: s for s in SCENARIOS}
PARAMS = [pytest.param(s.name, id=s.name) for s in SCENARIOS]


# ---- the driver (runs in a child interpreter) --------------------------------------------


def run_scenario() -> None:
    """Driver entry point: `python -c "...; run_scenario()" '<spec json>'`; result on stdout."""
    from otel_engine import AsyncLLM
    from otel_engine.config import EngineConfig
    from otel_engine.observability.setup import setup_main_process
    from otel_engine.observability.tracing import shutdown_telemetry

    spec = json.loads(sys.argv[1])
    config = EngineConfig.from_kwargs(
        model=spec["model"],
        multiprocess=True,
        tensor_parallel_size=spec["tp"],
        num_kv_blocks=64,
        otlp_endpoint=spec["endpoint"],
        otlp_protocol="grpc",
        otlp_logs=True,
        log_format="json",
        log_level=spec["log_level"],
        step_timeout=spec["step_timeout"],
        shutdown_timeout=3.0,
    )
    setup_main_process(config, role="crash_test_driver")
    engine = AsyncLLM.from_config(config)
    try:
        result = asyncio.run(_drive(engine, spec))
    finally:
        engine.shutdown()
        shutdown_telemetry(5.0)
    print(json.dumps(result), flush=True)


async def _drive(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from otel_engine import SamplingParams
    from otel_engine.observability.tracing import get_tracer

    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        stop=(STOP_CANARY,),
        stop_token_ids=(STOP_ID_CANARY,),
    )
    texts: dict[str, str] = {}
    num_tokens: dict[str, int] = {}
    killed: list[int] = []

    async def one(index: int, prompt: str) -> dict[str, Any]:
        request_id = f"{spec['name']}-req-{index}"
        with get_tracer().start_as_current_span("client.request"):
            try:
                async for output in engine.generate(prompt, params, request_id):
                    texts[request_id] = output.outputs[0].text
                    num_tokens[request_id] = len(output.outputs[0].token_ids)
                    if spec["kill"] and not killed and _all_have_tokens(num_tokens):
                        killed.append(_kill_descendant(spec["kill"]))
            except Exception as error:
                return {
                    "request_id": request_id,
                    "error": type(error).__name__,
                    "cause_type": getattr(error, "cause_type", None),
                    "failed_process": getattr(error, "failed_process", None),
                    "crash_context": getattr(error, "crash_context", None),
                }
        return {"request_id": request_id, "error": None}

    outcomes = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
    return {
        "outcomes": list(outcomes),
        "texts": texts,
        "num_tokens": num_tokens,
        "prompt_token_ids": [engine.encode(p) for p in PROMPTS],
        "killed_pid": killed[0] if killed else None,
    }


def _all_have_tokens(num_tokens: dict[str, int]) -> bool:
    """Every request streamed its first few tokens (the hang fault holds them after that)."""
    return len(num_tokens) == len(PROMPTS) and min(num_tokens.values()) >= MIN_GENERATED_TOKENS


def _kill_descendant(title: str) -> int:
    """SIGKILL the descendant of this process whose title is `title`; return its pid."""
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if (cmdline and cmdline[0].split()[0] == title) or proc.name() == title:
                proc.kill()
                return proc.pid
    raise RuntimeError(f"no descendant named {title}")


# ---- running the scenarios ---------------------------------------------------------------


@dataclass
class Run:
    """What one scenario left: the driver's result, its stderr, and what the receiver got."""

    scenario: Scenario
    returncode: int | None
    result: dict[str, Any]
    stderr: str
    spans: list[dict[str, Any]]
    log_records: list[dict[str, Any]]
    raw_otlp: list[bytes]
    leftovers: list[psutil.Process] = field(default_factory=list)

    def log_lines(self) -> list[dict[str, Any]]:
        """stderr lines that are JSON objects (a library may print other lines)."""
        records = []
        for line in self.stderr.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records


class _Driver:
    """One driver process, its receiver, and every descendant seen while it ran."""

    def __init__(self, scenario: Scenario, model_dir: str, receiver: OtlpReceiver) -> None:
        self.scenario = scenario
        self.receiver = receiver
        spec = {
            "name": scenario.name,
            "model": model_dir,
            "tp": scenario.tp,
            "kill": scenario.kill,
            "log_level": scenario.log_level,
            "step_timeout": scenario.step_timeout,
            "endpoint": receiver.endpoint,
        }
        env = clean_env(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if scenario.fault:
            env["OTEL_ENGINE_FAULT"] = scenario.fault
        code = "from tests.observability.test_crash_delivery import run_scenario; run_scenario()"
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {self.popen.pid: psutil.Process(self.popen.pid)}
        self.out: dict[str, bytes] = {}
        self._readers = [
            threading.Thread(target=self._read, args=(name,), daemon=True)
            for name in ("stdout", "stderr")
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, name: str) -> None:
        self.out[name] = getattr(self.popen, name).read()

    def sample(self) -> None:
        for proc in children_of(self.popen.pid):
            self.seen.setdefault(proc.pid, proc)

    def finish(self) -> Run:
        """Kill by pid whatever is still alive (after a timeout), then collect the run."""
        leftovers = [p for p in self.seen.values() if is_alive(p)]
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        for reader in self._readers:
            reader.join(5)
        stdout = self.out.get("stdout", b"").decode(errors="replace").strip()
        result = json.loads(stdout.splitlines()[-1]) if stdout else {}
        return Run(
            scenario=self.scenario,
            returncode=self.popen.returncode,
            result=result,
            stderr=self.out.get("stderr", b"").decode(errors="replace"),
            spans=self.receiver.spans(),
            log_records=self.receiver.log_records(),
            raw_otlp=[raw for signal in self.receiver.raw.values() for raw in signal],
            leftovers=leftovers,
        )


@pytest.fixture(scope="module")
def crash_runs(tiny_model_dir: str) -> dict[str, Run]:
    """Every scenario run to its end, all at once (each with its own receiver)."""
    runs: dict[str, Run] = {}
    with contextlib.ExitStack() as stack:
        drivers = []
        for scenario in SCENARIOS:
            receiver = stack.enter_context(OtlpReceiver("grpc"))
            drivers.append(_Driver(scenario, tiny_model_dir, receiver))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and any(d.popen.poll() is None for d in drivers):
            for driver in drivers:
                driver.sample()
            time.sleep(0.05)
        for driver in drivers:
            runs[driver.scenario.name] = driver.finish()
        assert_no_children([p for d in drivers for p in d.seen.values()], timeout=5.0)
    return runs


# ---- reading a run -----------------------------------------------------------------------


def crash_events(run: Run) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(span, event) for every `otel_engine.crash` event the receiver got."""
    return [
        (span, event)
        for span in run.spans
        for event in span["events"]
        if event["name"] == "otel_engine.crash"
    ]


def the_crash(run: Run) -> tuple[dict[str, Any], dict[str, Any]]:
    events = crash_events(run)
    assert 1 == len(events), (
        f"{run.scenario.name}: {len(events)} crash events\n{run.stderr[-3000:]}"
    )
    return events[0]


def dump_parts(event: dict[str, Any]) -> dict[str, Any]:
    attributes = event["attributes"]
    return {
        part: json.loads(attributes[f"otel_engine.crash.{part}"])
        for part in ("scheduler_output", "engine_config", "system_stats")
    }


def request_ids(run: Run) -> set[str]:
    return {f"{run.scenario.name}-req-{i}" for i in range(len(PROMPTS))}


# ---- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", PARAMS)
def test_every_request_gets_engine_dead_and_nothing_is_left(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The three requests, each with tokens generated before the fault, all fail with
    EngineDeadError; the driver exits 0 and every process the engine started is gone."""
    run = crash_runs[name]
    assert 0 == run.returncode, run.stderr[-3000:]
    assert [] == run.leftovers
    assert ["EngineDeadError"] * len(PROMPTS) == [o["error"] for o in run.result["outcomes"]]
    assert bool(run.scenario.kill) == (run.result["killed_pid"] is not None)
    assert all(n >= MIN_GENERATED_TOKENS for n in run.result["num_tokens"].values())


@pytest.mark.parametrize("name", PARAMS)
def test_exactly_one_crash_event_next_to_an_exception_on_an_error_span(
    crash_runs: dict[str, Run], name: str
) -> None:
    """One `otel_engine.crash` event in all the receiver got; its span (the engine core's
    failing step) has status ERROR and one `exception` event of the dump's failure type."""
    run = crash_runs[name]
    span, event = the_crash(run)
    failure = dump_parts(event)["system_stats"]["failure"]
    assert "engine_core.step" == span["name"]
    assert "engine_core" == span["resource"]["otel_engine.process.role"]
    assert "ERROR" == span["status"]["code"]
    exceptions = [e for e in span["events"] if e["name"] == "exception"]
    assert [failure["type"]] == [e["attributes"]["exception.type"] for e in exceptions]
    assert event["attributes"]["otel_engine.crash.reason"].startswith(failure["type"])


@pytest.mark.parametrize("name", PARAMS)
def test_crash_span_links_to_the_requests_of_its_batch(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The crash span links to the span of every request in the failing batch."""
    run = crash_runs[name]
    span, _ = the_crash(run)
    requests = [s for s in run.spans if s["name"] == "client.request"]
    assert len(PROMPTS) == len(requests)
    linked = {(link["trace_id"], link["span_id"]) for link in span["links"]}
    assert {(s["trace_id"], s["span_id"]) for s in requests} == linked


@pytest.mark.parametrize("name", PARAMS)
def test_crash_event_parts_hold_the_batch_and_the_config(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The three JSON parts parse; the batch lists every in-flight request id with its
    safe fields, the config has the tensor parallel size, the stats the scheduler state."""
    run = crash_runs[name]
    parts = dump_parts(the_crash(run)[1])
    batch = parts["scheduler_output"]
    assert request_ids(run) == {r["request_id"] for r in batch["requests"]}
    assert (len(PROMPTS), 0) == (batch["num_requests"], batch["num_omitted_requests"])
    for entry in batch["requests"]:
        assert entry["output_token_ids"] >= MIN_GENERATED_TOKENS
        assert entry["num_blocks"] == len(entry["block_ids"]) >= 1
        assert "RUNNING" == entry["status"]
        assert {"stop": 1, "stop_token_ids": 1, "max_tokens": MAX_TOKENS}.items() <= entry[
            "sampling_params"
        ].items()
    assert run.scenario.tp == parts["engine_config"]["tensor_parallel_size"]
    assert "LlamaForCausalLM" == parts["engine_config"]["architecture"]
    stats = parts["system_stats"]
    assert (len(PROMPTS), 0) == (stats["num_running"], stats["num_waiting"])
    assert stats["num_steps"] >= MIN_GENERATED_TOKENS
    assert "engine_core" in stats["process_rss_mib"]


@pytest.mark.parametrize("name", PARAMS)
def test_crash_names_the_failed_process_rank_and_cause(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The dump, the span event, the OTLP record and every client's error name the process
    and rank that failed and how (exception, died, timeout)."""
    run = crash_runs[name]
    scenario = run.scenario
    _, event = the_crash(run)
    failure = dump_parts(event)["system_stats"]["failure"]
    assert scenario.failure_type == failure["type"]
    assert failure["process"] in scenario.failed_processes
    assert (scenario.failed_rank, scenario.how) == (failure["rank"], failure["how"])
    expected_rank = -1 if scenario.failed_rank is None else scenario.failed_rank
    assert expected_rank == event["attributes"]["otel_engine.crash.failed_rank"]
    for outcome in run.result["outcomes"]:
        assert scenario.failure_type == outcome["cause_type"]
        assert outcome["failed_process"] in scenario.failed_processes


@pytest.mark.parametrize("name", PARAMS)
def test_exactly_one_crash_log_line_with_the_same_dump(
    crash_runs: dict[str, Run], name: str
) -> None:
    """stderr holds one `engine_crash_dump` JSON line whose parts are nested objects equal
    to the span event's, stamped with the crash span's trace and span ids."""
    run = crash_runs[name]
    span, event = the_crash(run)
    lines = [r for r in run.log_lines() if r.get("event") == "engine_crash_dump"]
    assert 1 == len(lines)
    line = lines[0]
    assert dump_parts(event) == {
        part: line[part] for part in ("scheduler_output", "engine_config", "system_stats")
    }
    assert (span["trace_id"], span["span_id"]) == (line["trace_id"], line["span_id"])
    assert ("engine_core", "critical") == (line["role"], line["level"])


@pytest.mark.parametrize("name", PARAMS)
def test_one_fatal_otlp_log_record_tied_to_the_crash_span(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The same dump also arrives as one OTLP log record, severity FATAL, with the
    exception type, in the crash span's context."""
    run = crash_runs[name]
    span, event = the_crash(run)
    parts = dump_parts(event)
    records = [r for r in run.log_records if r["body"] == "engine_crash_dump"]
    assert 1 == len(records)
    record = records[0]
    assert 21 <= record["severity_number"] <= 24  # FATAL..FATAL4
    assert (span["trace_id"], span["span_id"]) == (record["trace_id"], record["span_id"])
    assert parts["system_stats"]["failure"]["type"] == record["attributes"]["exception.type"]
    assert parts == {
        part: json.loads(record["attributes"][part])
        for part in ("scheduler_output", "engine_config", "system_stats")
    }


@pytest.mark.parametrize("name", PARAMS)
def test_client_error_points_at_the_crash_span(crash_runs: dict[str, Run], name: str) -> None:
    """The EngineDeadError every client got carries the W3C context of the crash span."""
    run = crash_runs[name]
    span, _ = the_crash(run)
    for outcome in run.result["outcomes"]:
        _, trace_id, span_id, _ = outcome["crash_context"]["traceparent"].split("-")
        assert (span["trace_id"], span["span_id"]) == (trace_id, span_id)


def _secrets(run: Run) -> list[str]:
    texts = list(run.result["texts"].values())
    assert len(texts) == len(PROMPTS)
    assert all(len(t) >= 6 for t in texts), texts  # a real canary, not a common fragment
    windows = []
    for ids in run.result["prompt_token_ids"]:
        middle = ids[len(ids) // 2 - TOKEN_WINDOW // 2 :][:TOKEN_WINDOW]
        windows += [",".join(map(str, middle)), ", ".join(map(str, middle))]
    return [PROMPT_CANARY, STOP_CANARY, *texts, *windows]


@pytest.mark.parametrize("name", PARAMS)
def test_no_prompt_stop_string_or_generated_text_in_logs(
    crash_runs: dict[str, Run], name: str
) -> None:
    """Prompt canaries, stop-string canaries, the text generated before the crash and runs
    of prompt token ids appear nowhere on stderr, raw or JSON-decoded, at INFO or DEBUG."""
    run = crash_runs[name]
    decoded = "\n".join(json.dumps(r, ensure_ascii=False) for r in run.log_lines())
    assert f"{name}-req-0" in run.stderr  # the search sees what the dump does carry
    for secret in _secrets(run):
        assert secret not in run.stderr
        assert secret not in decoded


@pytest.mark.parametrize("name", PARAMS)
def test_no_prompt_stop_string_or_generated_text_in_otlp(
    crash_runs: dict[str, Run], name: str
) -> None:
    """The same secrets appear in no OTLP payload: not in the raw protobuf bytes, not in
    the decoded spans and log records."""
    run = crash_runs[name]
    assert run.spans
    assert run.log_records
    decoded = json.dumps([run.spans, run.log_records], ensure_ascii=False, default=str)
    assert any(f"{name}-req-0".encode() in raw for raw in run.raw_otlp)
    for secret in _secrets(run):
        assert not any(secret.encode() in raw for raw in run.raw_otlp)
        assert secret not in decoded
