"""The server's telemetry end to end: real `serve` processes at TP=2, real OTLP receivers.

Two servers run side by side (one module fixture, so the file stays fast on two cores):

- `grpc`: exports over OTLP/gRPC (the standard `OTEL_*` variables), `--log-format json`,
  `--otlp-logs`, batch delays of ten minutes so nothing leaves before shutdown. It serves a
  completion with a client `traceparent`, a streamed chat completion and a 404, then gets
  SIGTERM: whatever reached the receiver was flushed by the orderly shutdown.
- `http`: exports over OTLP/HTTP (`--otlp-endpoint`/`--otlp-protocol` flags) with an injected
  worker fault and `--log-prompts`: a completion with a client `traceparent` succeeds, then a
  long one is in flight when rank 1 raises; the engine dies and the server exits 1 after
  flushing.

Prompts, stop strings and a `response_format` schema carry canary strings that must appear
in no output, except in the `request.prompt` log lines that `--log-prompts` asks for.
"""

from __future__ import annotations

import base64
import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_engine.sched.kv_cache import hash_block, root_hash
from tests.helpers.otlp_receiver import OtlpReceiver
from tests.helpers.paths import REPO_ROOT
from tests.helpers.procs import ServerProcess
from tests.observability.conftest import clean_env

pytestmark = pytest.mark.slow  # starts servers or engine processes

MODEL = "tiny"
CANARY = "zq9-SERVE-CANARY-71c3"
STOP_CANARY = "zq9-STOP-CANARY-2d8e"
SCHEMA_CANARY = "zq9-SCHEMA-CANARY-5a0f"  # a property name of a response_format schema
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "canary",
        "schema": {
            "type": "object",
            "properties": {SCHEMA_CANARY: {"type": "string"}},
            "required": [SCHEMA_CANARY],
        },
    },
}
FAULT_STEP = 24  # the first request needs 4 steps; the long one is in flight at this step
PROTOCOLS = {"grpc": "grpc", "http": "http/protobuf"}
TRACE_IDS = {"grpc": "4bf92f3577b34da6a3ce929d0e0e4736", "http": "5ce0e9a56015fec5aadfa328ae398115"}
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACESTATE = "vendor=canary-free"
ROLES = {"api_server", "engine_core", "worker"}
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")
# Two prompts (token ids) that share 40 tokens: the second finds two full 16-token blocks
# of the first in the prefix cache.
SHARED_PREFIX = list(range(300, 340))
PREFIX_PROMPTS = {"prefix_first": [*SHARED_PREFIX, 7, 8, 9], "prefix_second": [*SHARED_PREFIX, 11]}
DOC_METRIC = re.compile(r"^\| `(otel_engine_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", re.M)


@dataclass
class Run:
    """What one server run left behind."""

    protocol: str
    server: ServerProcess
    receiver: OtlpReceiver
    responses: dict[str, httpx.Response] = field(default_factory=dict)
    metrics_before: str = ""
    metrics_after: str = ""
    num_spans_before_sigterm: int = -1
    exit_code: int | None = None

    @property
    def trace_id(self) -> str:
        return TRACE_IDS[self.protocol]

    def spans(self, name: str | None = None) -> list[dict[str, Any]]:
        return [s for s in self.receiver.spans() if name is None or s["name"] == name]

    def one_span(self, name: str, trace_id: str | None = None) -> dict[str, Any]:
        found = [s for s in self.spans(name) if s["trace_id"] == (trace_id or self.trace_id)]
        assert 1 == len(found), f"{name}: {len(found)} spans in the trace"
        return found[0]


def _headers(trace_id: str) -> dict[str, str]:
    return {
        "traceparent": f"00-{trace_id}-{CLIENT_SPAN_ID}-01",
        "tracestate": TRACESTATE,
        "user-agent": "telemetry-test/1.0",
    }


def _completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"{CANARY} the engine schedules requests in steps",
        "max_tokens": max_tokens,
        "stop": [STOP_CANARY],
        **extra,
    }


def _start(key: str, receiver: OtlpReceiver, model_dir: str, log_dir: Path) -> ServerProcess:
    args = ["--model", model_dir, "--served-model-name", MODEL, "--tensor-parallel-size", "2"]
    args += ["--log-format", "json", "--num-kv-blocks", "128", "--shutdown-timeout", "10"]
    if key == "grpc":
        env = clean_env(
            **receiver.env(),
            OTEL_BSP_SCHEDULE_DELAY="600000",
            OTEL_METRIC_EXPORT_INTERVAL="600000",
        )
        args.append("--otlp-logs")
    else:
        env = clean_env(
            OTEL_BSP_SCHEDULE_DELAY="200",
            OTEL_ENGINE_FAULT=f"worker:raise:rank=1:step={FAULT_STEP}",
        )
        args += ["--otlp-endpoint", receiver.endpoint, "--otlp-protocol", "http/protobuf"]
        args.append("--log-prompts")
    server = ServerProcess(args, log_path=log_dir / f"serve-{key}.log")
    server.env = {**env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return server.start()


def _drive_grpc(run: Run) -> None:
    with httpx.Client(base_url=run.server.base_url, timeout=60, trust_env=False) as client:
        run.metrics_before = client.get("/metrics").text
        run.responses["completion"] = client.post(
            "/v1/completions",
            json=_completion(6, temperature=0.7, top_p=0.9, top_k=20, seed=1234),
            headers=_headers(run.trace_id),
        )
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Say {CANARY} back"}],
            "max_tokens": 5,
            "stop": STOP_CANARY,
            "response_format": SCHEMA_FORMAT,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as response:
            response.read()
            run.responses["chat"] = response
        run.responses["not_found"] = client.post(
            "/v1/completions",
            json={**_completion(2), "model": "no-such-model"},
            headers=_headers("6" * 32),
        )
        for key, prompt in PREFIX_PROMPTS.items():
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            run.responses[key] = client.post("/v1/completions", json=body)
        run.metrics_after = client.get("/metrics").text
    run.num_spans_before_sigterm = len(run.receiver.spans())
    run.server.terminate()


def _drive_http(run: Run) -> None:
    with httpx.Client(base_url=run.server.base_url, timeout=60, trust_env=False) as client:
        run.responses["completion"] = client.post(
            "/v1/completions", json=_completion(4), headers=_headers(run.trace_id)
        )
        run.receiver.wait_for(_all_step_spans_exported, timeout=15)
        run.responses["crash"] = client.post(
            "/v1/completions",
            json=_completion(300, ignore_eos=True, response_format=SCHEMA_FORMAT),
            headers=_headers("7" * 32),
        )


def _all_step_spans_exported(receiver: OtlpReceiver) -> bool:
    """Every step so far has its engine-core span and one worker span per rank."""
    spans = receiver.spans()
    num_steps = sum(1 for s in spans if s["name"] == "engine_core.step")
    ranks = [s["resource"].get("otel_engine.worker.rank") for s in spans]
    return num_steps >= 4 and ranks.count(0) == ranks.count(1) == num_steps


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Both server runs, finished (exited), with their receivers still holding the data."""
    log_dir = tmp_path_factory.mktemp("serve-logs")
    with contextlib.ExitStack() as stack:
        result: dict[str, Run] = {}
        for key, protocol in PROTOCOLS.items():
            receiver = stack.enter_context(OtlpReceiver(protocol))
            server = _start(key, receiver, tiny_model_dir, log_dir)
            stack.callback(server.cleanup)
            result[key] = Run(key, server, receiver)
        for run in result.values():
            run.server.wait_healthy(timeout=180)
        _drive_grpc(result["grpc"])
        _drive_http(result["http"])
        for run in result.values():
            run.exit_code = run.server.wait(timeout=60)
        time.sleep(0.2)  # the receivers' last requests are recorded before the servers exit
        yield result


@pytest.fixture(params=["grpc", "http"])
def run(runs: dict[str, Run], request: pytest.FixtureRequest) -> Run:
    return runs[request.param]


def test_http_server_span_has_the_client_as_parent(run: Run) -> None:
    """The SERVER span continues the client's trace (traceparent and tracestate) with the
    HTTP semantic-convention attributes."""
    span = run.one_span("POST /v1/completions")

    assert ("SERVER", CLIENT_SPAN_ID, TRACESTATE) == (
        span["kind"],
        span["parent_span_id"],
        span["trace_state"],
    )
    assert {
        "http.request.method": "POST",
        "url.path": "/v1/completions",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
        "server.address": "127.0.0.1",
        "server.port": run.server.port,
        "user_agent.original": "telemetry-test/1.0",
    }.items() <= span["attributes"].items()
    assert "UNSET" == span["status"]["code"]


def test_genai_span_is_a_child_of_the_http_span_with_the_genai_attributes(run: Run) -> None:
    """`text_completion tiny` under the SERVER span: request, response and usage attributes."""
    http_span = run.one_span("POST /v1/completions")
    span = run.one_span(f"text_completion {MODEL}")
    body = run.responses["completion"].json()
    attributes = span["attributes"]

    assert (http_span["span_id"], "INTERNAL") == (span["parent_span_id"], span["kind"])
    assert {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": body["usage"]["completion_tokens"],
        "gen_ai.response.id": body["id"],
        "gen_ai.response.model": MODEL,
        "gen_ai.response.finish_reasons": [body["choices"][0]["finish_reason"]],
        "gen_ai.usage.input_tokens": body["usage"]["prompt_tokens"],
        "gen_ai.usage.output_tokens": body["usage"]["completion_tokens"],
    }.items() <= attributes.items()
    for name in ("queue_time_s", "ttft_s", "tpot_s", "e2e_s"):
        assert attributes[f"otel_engine.request.{name}"] >= 0


def test_genai_span_carries_the_sampling_parameters(runs: dict[str, Run]) -> None:
    """temperature, top_p, top_k and seed as the client sent them."""
    attributes = runs["grpc"].one_span(f"text_completion {MODEL}")["attributes"]

    assert {
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 20,
        "gen_ai.request.seed": 1234,
        "gen_ai.output.type": "text",
    }.items() <= attributes.items()


def test_genai_span_events_follow_the_request_in_time_order(run: Run) -> None:
    """queued <= scheduled <= first_token <= finished, inside the span."""
    span = run.one_span(f"text_completion {MODEL}")
    events = {e["name"]: e["time_unix_nano"] for e in span["events"]}
    names = ["queued", "scheduled", "first_token", "finished"]
    times = [events[f"otel_engine.request.{name}"] for name in names]

    assert sorted(times) == times
    assert span["start_time_unix_nano"] <= times[0]
    assert times[-1] <= span["end_time_unix_nano"]


def test_streamed_chat_gets_a_chat_span(runs: dict[str, Run]) -> None:
    """A streamed chat completion: `chat tiny`, stream flag, usage matching the last chunk."""
    run = runs["grpc"]
    [span] = run.spans(f"chat {MODEL}")
    usage_chunk = [line for line in run.responses["chat"].text.splitlines() if '"usage":{' in line]

    assert span["attributes"]["gen_ai.operation.name"] == "chat"
    assert span["attributes"]["otel_engine.request.stream"] is True
    assert span["attributes"]["gen_ai.output.type"] == "json"  # its response_format
    assert (
        f'"completion_tokens":{span["attributes"]["gen_ai.usage.output_tokens"]}'
        in (usage_chunk[-1])
    )


def test_step_and_worker_spans_link_to_the_request_from_three_roles(run: Run) -> None:
    """engine_core.step spans link to the GenAI span; worker.execute spans are their children;
    the trace's spans come from api_server, engine_core and worker processes."""
    genai = run.one_span(f"text_completion {MODEL}")
    target = (genai["trace_id"], genai["span_id"])
    steps = [
        s
        for s in run.spans("engine_core.step")
        if target in {(link["trace_id"], link["span_id"]) for link in s["links"]}
    ]
    step_ids = {s["span_id"] for s in steps}
    workers = [s for s in run.spans("worker.execute") if s["parent_span_id"] in step_ids]
    roles = {
        s["resource"]["otel_engine.process.role"]
        for s in [genai, run.one_span("POST /v1/completions"), *steps, *workers]
    }

    assert genai["attributes"]["gen_ai.usage.output_tokens"] <= len(steps)
    assert {0, 1} == {w["resource"]["otel_engine.worker.rank"] for w in workers}
    assert ROLES == roles


def test_client_error_leaves_the_http_span_status_unset(runs: dict[str, Run]) -> None:
    """A 404 (unknown model) is the client's error: status UNSET, no error.type."""
    span = runs["grpc"].one_span("POST /v1/completions", "6" * 32)

    assert 404 == span["attributes"]["http.response.status_code"]
    assert "UNSET" == span["status"]["code"]
    assert "error.type" not in span["attributes"]


def test_spans_of_finished_requests_are_flushed_on_sigterm(runs: dict[str, Run]) -> None:
    """Nothing was exported before SIGTERM (10-minute batch delay); after a clean exit the
    spans of every finished request are at the receiver, from all three roles."""
    run = runs["grpc"]

    assert (0, 0) == (run.num_spans_before_sigterm, run.exit_code)
    assert run.one_span(f"text_completion {MODEL}")
    assert run.spans(f"chat {MODEL}")
    assert ROLES == {s["resource"]["otel_engine.process.role"] for s in run.spans()}


def test_metrics_are_exported_over_otlp_at_shutdown(runs: dict[str, Run]) -> None:
    """The api_server's registry reaches the receiver (final export on shutdown)."""
    names = {m["name"] for m in runs["grpc"].receiver.metrics()}

    assert {"otel_engine_request_success", "otel_engine_time_to_first_token_seconds"} <= names


def test_every_log_line_is_json_with_the_required_fields(runs: dict[str, Run]) -> None:
    """Every stdout/stderr line parses as a JSON object with timestamp (RFC 3339 UTC), level,
    event, logger, role, pid; rank on worker lines; 32/16-hex trace and span ids."""
    records = _records(runs["grpc"])

    assert records
    for record in records:
        assert {"timestamp", "level", "event", "logger", "role", "pid"} <= record.keys(), record
        assert RFC3339_UTC.match(record["timestamp"]), record
        assert record["role"] != "worker" or isinstance(record.get("rank"), int), record
        assert "trace_id" not in record or HEX32.match(record["trace_id"]), record
        assert "span_id" not in record or HEX16.match(record["span_id"]), record


def test_log_lines_come_from_all_three_roles(runs: dict[str, Run]) -> None:
    """api_server, engine_core and both workers' lines reach the same output."""
    records = _records(runs["grpc"])

    assert ROLES == {r["role"] for r in records}
    assert {0, 1} == {r["rank"] for r in records if r["role"] == "worker"}


def test_lines_logged_while_serving_carry_the_trace_id(runs: dict[str, Run]) -> None:
    """Every line with the request's id carries the client's trace id; among them one
    `request.finished` line with its outcome and timings; the access log line too."""
    run = runs["grpc"]
    request_id = run.responses["completion"].json()["id"]
    records = _records(run)
    mine = [r for r in records if r.get("request_id") == request_id]
    [finished] = [r for r in mine if r["event"] == "request.finished"]
    access = [r for r in records if r["event"] == "http.access" and r.get("http_method") == "POST"]

    assert {run.trace_id} == {r.get("trace_id") for r in mine}
    assert ("length", 6) == (finished["finish_reason"], finished["num_generated_tokens"])
    assert finished["ttft_s"] <= finished["e2e_s"]
    assert run.trace_id in {r.get("trace_id") for r in access}


def test_otlp_log_records_are_tied_to_the_request_span(runs: dict[str, Run]) -> None:
    """--otlp-logs: the `request.finished` record carries the GenAI span's trace and span."""
    run = runs["grpc"]
    genai = run.one_span(f"text_completion {MODEL}")
    records = [r for r in run.receiver.log_records() if r["body"] == "request.finished"]

    assert (genai["trace_id"], genai["span_id"]) in {(r["trace_id"], r["span_id"]) for r in records}


def test_metrics_has_every_documented_family(runs: dict[str, Run]) -> None:
    """Each metric of docs/observability.md is exposed at /metrics with its documented type."""
    documented = DOC_METRIC.findall((REPO_ROOT / "docs" / "observability.md").read_text())
    exposed = {f.name: f.type for f in text_string_to_metric_families(runs["grpc"].metrics_after)}

    assert len(documented) >= 18
    for name, kind in documented:
        assert kind == exposed.get(name.removesuffix("_total")), name


def test_counters_and_histograms_move_after_requests(runs: dict[str, Run]) -> None:
    """Success, errors, tokens, TTFT, TPOT, e2e, queue time and step histograms all grew."""
    run = runs["grpc"]
    before, after = _samples(run.metrics_before), _samples(run.metrics_after)
    moved = [
        'otel_engine_request_success_total{finish_reason="length"}',
        'otel_engine_request_errors_total{error_type="model_not_found"}',
        "otel_engine_prompt_tokens_total",
        "otel_engine_generation_tokens_total",
        "otel_engine_time_to_first_token_seconds_count",
        "otel_engine_time_per_output_token_seconds_count",
        "otel_engine_e2e_request_latency_seconds_count",
        "otel_engine_request_queue_time_seconds_count",
        "otel_engine_step_duration_seconds_count",
        "otel_engine_step_batch_size_count",
    ]

    for key in moved:
        assert after.get(key, 0) > before.get(key, 0), key
    assert 1 == after['otel_engine_engine_health_state{state="healthy"}']


def test_every_sample_names_the_served_model(runs: dict[str, Run]) -> None:
    """Dashboards select a model by the `model_name` label: every sample has the same one."""
    names = {
        sample.labels.get("model_name")
        for family in text_string_to_metric_families(runs["grpc"].metrics_after)
        for sample in family.samples
    }

    assert len(names) == 1
    assert names.pop()


def test_canary_appears_in_no_log_otlp_payload_or_metrics(runs: dict[str, Run]) -> None:
    """Prompt, stop-string and schema canaries are in none of: log output (but the `request.prompt`
    lines of `--log-prompts`), raw OTLP bytes, /metrics."""
    for run in runs.values():
        log = [line for line in run.server.lines() if '"event": "request.prompt"' not in line]
        outputs = {
            "log": "\n".join(log).encode(),
            "metrics": (run.metrics_before + run.metrics_after).encode(),
            **{f"otlp-{s}": b"".join(raw) for s, raw in run.receiver.raw.items()},
        }
        for where, data in outputs.items():
            for canary in (CANARY, STOP_CANARY, SCHEMA_CANARY):
                assert canary.encode() not in data, f"{canary} in {run.protocol} {where}"
            for block_hash in _prefix_block_hashes():  # a dictionary attack away from the ids
                for form in (block_hash, block_hash.hex().encode(), base64.b64encode(block_hash)):
                    assert form not in data, f"a block hash in {run.protocol} {where}"


def _prefix_block_hashes() -> list[bytes]:
    first = hash_block(root_hash(), SHARED_PREFIX[:16])
    return [first, hash_block(first, SHARED_PREFIX[16:32])]


def test_prefix_cache_hit_shows_in_usage_span_log_and_metrics(runs: dict[str, Run]) -> None:
    """The second of two prompts sharing 40 tokens reuses two 16-token blocks: 32 cached
    tokens in `usage.prompt_tokens_details`, the GenAI span's
    `gen_ai.usage.cache_read.input_tokens`, the `request.finished` line and the counters."""
    run = runs["grpc"]
    first, second = (run.responses[key].json() for key in PREFIX_PROMPTS)
    [span] = [
        s
        for s in run.spans(f"text_completion {MODEL}")
        if s["attributes"]["gen_ai.response.id"] == second["id"]
    ]
    [finished] = [
        r
        for r in _records(run)
        if r["event"] == "request.finished" and r.get("request_id") == second["id"]
    ]
    metrics = _samples(run.metrics_after)

    assert (0, 32) == tuple(
        body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in (first, second)
    )
    assert 32 == span["attributes"]["gen_ai.usage.cache_read.input_tokens"]
    assert 32 == finished["num_cached_tokens"]
    assert metrics["otel_engine_prefix_cache_hits_total"] >= 32
    assert metrics["otel_engine_prefix_cache_queries_total"] >= 43 + 41
    assert metrics["otel_engine_kv_cache_cached_blocks"] >= 2


def test_log_prompts_logs_prompt_and_stop_strings_once_per_request(
    runs: dict[str, Run],
) -> None:
    """--log-prompts: one `request.prompt` line per request with its prompt and stop strings
    (the other server, without the flag, has none)."""
    prompts = [r for r in _records(runs["http"]) if r["event"] == "request.prompt"]

    assert 2 == len(prompts)
    assert all(CANARY in r["prompt"] and [STOP_CANARY] == r["stop"] for r in prompts)
    assert not [r for r in _records(runs["grpc"]) if r["event"] == "request.prompt"]


def test_engine_failure_ends_the_request_span_with_error_and_a_crash_link(
    runs: dict[str, Run],
) -> None:
    """The in-flight request's GenAI span: status ERROR, error.type the cause class, an
    `exception` event, and a link to the failed step span; its HTTP span is a 500 ERROR."""
    run = runs["http"]
    genai = run.one_span(f"text_completion {MODEL}", "7" * 32)
    http_span = run.one_span("POST /v1/completions", "7" * 32)
    failed = {
        (s["trace_id"], s["span_id"]): s for s in run.spans() if s["status"]["code"] == "ERROR"
    }
    linked = [failed.get((link["trace_id"], link["span_id"])) for link in genai["links"]]

    assert 500 == run.responses["crash"].status_code
    assert ("ERROR", "InjectedFault") == (
        genai["status"]["code"],
        genai["attributes"]["error.type"],
    )
    assert "exception" in [e["name"] for e in genai["events"]]
    assert "engine_core.step" in [s["name"] for s in linked if s is not None]
    assert ("ERROR", 500) == (
        http_span["status"]["code"],
        http_span["attributes"]["http.response.status_code"],
    )


def test_server_exits_1_after_flushing_on_engine_death(runs: dict[str, Run]) -> None:
    """The server whose engine died exits 1, and the failed request's spans reached the
    receiver first."""
    run = runs["http"]

    assert 1 == run.exit_code
    assert run.one_span(f"text_completion {MODEL}", "7" * 32)["end_time_unix_nano"]


def _records(run: Run) -> list[dict[str, Any]]:
    import json

    records = [json.loads(line) for line in run.server.lines() if line.strip()]
    assert all(isinstance(r, dict) for r in records)
    return records


def _samples(text: str) -> dict[str, float]:
    """Samples by name and labels, leaving out the `model_name` label every sample has."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(
                f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_decode_only_steps_carry_their_bandwidth_against_the_measured_peak(
    runs: dict[str, Run],
) -> None:
    """Every step span says the bytes rank 0 read; a step of decodes alone (as many tokens
    as requests) also its bandwidth and ratio to the peak, which /metrics shows too."""
    run = runs["grpc"]
    steps = [s["attributes"] for s in run.spans("engine_core.step")]
    decodes = [
        a
        for a in steps
        if a["otel_engine.step.num_batched_tokens"] == a["otel_engine.step.num_requests"]
    ]
    others = [a for a in steps if a not in decodes]
    gauges = {
        s.name: s.value
        for family in text_string_to_metric_families(run.metrics_after)
        for s in family.samples
        if "bandwidth" in s.name
    }

    assert decodes
    assert others
    assert all(a["otel_engine.step.bytes_read"] > 0 for a in steps)
    assert all(a["otel_engine.step.decode_bandwidth_bytes_per_second"] > 0 for a in decodes)
    assert all(0 < a["otel_engine.step.decode_bandwidth_ratio"] <= 4 for a in decodes)
    assert not [a for a in others if "otel_engine.step.decode_bandwidth_ratio" in a]
    assert gauges["otel_engine_memory_read_bandwidth_bytes_per_second"] > 0
    assert 0 < gauges["otel_engine_decode_bandwidth_ratio"] <= 4
    assert gauges["otel_engine_decode_bandwidth_bytes_per_second"] == pytest.approx(
        gauges["otel_engine_decode_bandwidth_ratio"]
        * gauges["otel_engine_memory_read_bandwidth_bytes_per_second"]
    )


def test_the_crash_dump_holds_the_peak_and_the_last_decode_bandwidth(
    runs: dict[str, Run],
) -> None:
    """The dump of the worker fault (TP=2): rank 0's measured peak, reached through its
    ready message, and the last decode-only step's bandwidth before the fault."""
    import json

    events = [
        e
        for s in runs["http"].spans("engine_core.step")
        for e in s["events"]
        if e["name"] == "otel_engine.crash"
    ]
    (event,) = events
    stats = json.loads(event["attributes"]["otel_engine.crash.system_stats"])
    bandwidth = stats["memory_bandwidth"]

    assert bandwidth["peak_bytes_per_second"] > 0
    assert bandwidth["decode_bytes_per_second"] > 0
    assert 0 < bandwidth["decode_ratio"] <= 4
