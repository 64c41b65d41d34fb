"""The crash dumper on its own: allowlist redaction, the three parts, the size cap, delivery
to a real span and the real JSON log renderer, and Hypothesis-generated hostile input.

Processes, the OTLP receiver and real faults are in `test_crash_delivery.py`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import prepare_model_input
from otel_engine.engine.structured_output import from_response_format
from otel_engine.executor.rank_plans import rank_plans
from otel_engine.ipc.messages import ErrorInfo
from otel_engine.observability import crash_dump, redaction
from otel_engine.observability.crash_delivery import failure_summary, report_crash
from otel_engine.observability.crash_dump import (
    MAX_DUMP_BYTES,
    build_dump,
    engine_config_part,
    scheduler_output_part,
    system_stats_part,
    to_json,
)
from otel_engine.observability.log_render import (
    PipelineFormatter,
    remove_meta,
    render_json,
    structure_exception,
)
from otel_engine.observability.logging import shared_processors
from otel_engine.observability.redaction import dump_object
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.kv_cache import BlockAllocator, update_block_hashes
from otel_engine.sched.request import Request, RequestStatus
from otel_engine.sched.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

CANARY = "zq7-CANARY-dump-3e9d"
CANARY_IDS = [901, 902, 903, 904, 905, 906]
PARTS = ("scheduler_output", "engine_config", "system_stats")
HYPOTHESIS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def strict_json(text: str) -> Any:
    """Parse RFC 8259 JSON: NaN and Infinity are not JSON."""

    def reject(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=reject)


def numbers_in(value: Any) -> set[float]:
    """Every number anywhere in a dumped structure (bools aside)."""
    if isinstance(value, dict):
        return set().union(*map(numbers_in, value.values()))
    if isinstance(value, list):
        return set().union(*map(numbers_in, value))
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return {value} if is_number else set()


def make_request(request_id: str = "req-0", num_prompt: int = 6, **fields: Any) -> Request:
    params = SamplingParams(max_tokens=32, temperature=0.7, seed=424242, stop=(CANARY,))
    values: dict[str, Any] = {
        "request_id": request_id,
        "prompt_token_ids": (CANARY_IDS * (num_prompt // 6 + 1))[:num_prompt],
        "sampling_params": params,
        "output_token_ids": [907, 908],
        "block_ids": [3, 4],
        "status": RequestStatus.RUNNING,
    }
    values.update(fields)
    return Request(**values)


def real_step(num_requests: int, prompt_lens: list[int], num_blocks: int) -> SchedulerOutput:
    """A real scheduler's first step over `num_requests` requests."""
    scheduler = Scheduler(
        BlockAllocator(num_blocks, 16),
        max_num_seqs=num_requests,
        max_num_batched_tokens=sum(prompt_lens),
        max_model_len=4096,
    )
    for index, length in enumerate(prompt_lens):
        fresh = {"output_token_ids": [], "block_ids": [], "status": RequestStatus.WAITING}
        scheduler.add(make_request(f"req-{index}", length, **fresh))
    return scheduler.schedule()


# ---- allowlist redaction -----------------------------------------------------------------


def test_request_dump_has_counts_and_safe_fields_only() -> None:
    """A Request dumps its id, counts of its token lists, block ids and status; no token id
    and no stop string or seed value appears."""
    dump = dump_object(make_request())
    assert {
        "request_id": "req-0",
        "prompt_token_ids": 6,
        "output_token_ids": 2,
        "block_ids": [3, 4],
        "status": "RUNNING",
        "trace_link": False,
    }.items() <= dump.items()
    assert {"stop": 1, "seed": True, "max_tokens": 32, "temperature": 0.7}.items() <= dump[
        "sampling_params"
    ].items()
    assert CANARY not in to_json(dump)
    assert numbers_in(dump).isdisjoint([424242, *CANARY_IDS, 907, 908])
    assert "unlisted_fields" not in dump
    assert dump["prompt_logprobs"] is None  # a counted field that is unset: no error in its place


def test_request_dump_shows_cached_tokens_but_never_block_hashes() -> None:
    """Block hashes are derived from token ids (a short prompt's hash is a dictionary attack
    away from the prompt): a dump says how many a request has, never which; the number of
    prompt tokens it found cached is shown."""
    request = make_request(num_prompt=40, num_cached_tokens=32, num_hashed_blocks=2)
    hashes = update_block_hashes(request, 16)
    dump = to_json(dump_object(request))

    assert 2 == len(hashes)
    assert {"block_hashes": 2, "num_cached_tokens": 32, "num_hashed_blocks": 2}.items() <= (
        dump_object(request).items()
    )
    for block_hash in hashes:
        for form in (block_hash.hex(), base64.b64encode(block_hash).decode(), repr(block_hash)):
            assert form not in dump


def test_logit_bias_is_dumped_as_a_count_and_penalties_as_values() -> None:
    """The token ids a client biased are its choice of words: a dump shows how many, never
    which; penalties, min_p and min_tokens are plain numbers."""
    params = SamplingParams(
        max_tokens=8,
        logit_bias=((CANARY_IDS[0], 5.0), (CANARY_IDS[1], -100.0)),
        presence_penalty=0.5,
        repetition_penalty=1.25,
        min_tokens=3,
    )

    dump = dump_object(params)

    assert {"logit_bias": 2, "presence_penalty": 0.5, "repetition_penalty": 1.25}.items() <= (
        dump.items()
    )
    assert 3 == dump["min_tokens"]
    assert numbers_in(dump).isdisjoint(CANARY_IDS)
    assert "unlisted_fields" not in dump


def test_a_json_schema_is_dumped_as_its_size_and_a_hash() -> None:
    """A response_format schema names the client's fields (here the canary, as a property
    name): a dump shows its type, byte size and a short hash, never its text; a request's
    grammar only as whether it has one."""
    schema = {"type": "object", "properties": {CANARY: {"type": "integer"}}}
    spec = from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    request = make_request(sampling_params=SamplingParams(structured_output=spec))
    request.grammar = object()  # type: ignore[assignment]

    dump = dump_object(request)
    part = dump["sampling_params"]["structured_output"]

    assert part["type"] == "json_schema"
    assert part["json_schema"]["bytes"] == len(spec.json_schema.encode())  # type: ignore[union-attr]
    assert len(part["json_schema"]["sha256"]) == 16
    assert dump["grammar"] is True
    assert CANARY not in to_json(dump)
    assert dump_object(SamplingParams())["structured_output"] is None


def test_field_added_to_a_dataclass_is_left_out_and_named() -> None:
    """A field the policy does not name (added later, in a subclass here) is not dumped;
    its name and type are listed under `unlisted_fields`."""

    @dataclass(slots=True, eq=False)
    class RequestWithPrompt(Request):
        prompt_text: str = ""
        logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)

    request = RequestWithPrompt(
        request_id="req-1",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(),
        prompt_text=CANARY,
        logit_bias={901: 5.0},
    )
    dump = dump_object(request)
    assert {"prompt_text": "str", "logit_bias": "dict"} == dump["unlisted_fields"]
    assert "prompt_text" not in dump
    assert "logit_bias" not in dump
    assert CANARY not in to_json(dump)
    assert 901 not in numbers_in(dump)


def test_field_added_to_a_struct_is_left_out_and_named() -> None:
    """The same for a msgspec Struct (SamplingParams gains a schema field)."""

    class ParamsWithSchema(SamplingParams, frozen=True, kw_only=True):
        json_schema: str = ""

    dump = dump_object(ParamsWithSchema(json_schema=CANARY))
    assert {"json_schema": "str"} == dump["unlisted_fields"]
    assert CANARY not in to_json(dump)


def test_plain_class_with_a_policy_lists_its_other_attributes() -> None:
    """A plain (non-dataclass) type with a policy: its public attributes outside the
    policy are listed, not dumped."""

    class Batch:
        __crash_dump__: ClassVar[dict[str, str]] = {"num_seqs": "value"}

        def __init__(self) -> None:
            self.num_seqs = 3
            self.prompts = [CANARY]

    assert {"num_seqs": 3, "unlisted_fields": {"prompts": "list"}} == dump_object(Batch())


def test_type_without_a_policy_is_redacted_whole() -> None:
    """An object of a type with no `__crash_dump__` becomes only its type name."""
    assert {"redacted": "SimpleNamespace"} == dump_object(SimpleNamespace(prompt=CANARY))


def test_nested_object_without_a_policy_is_redacted() -> None:
    """A `nested` field holding an unknown type is redacted, not serialized."""
    dump = dump_object(make_request(sampling_params=SimpleNamespace(stop=CANARY)))
    assert {"redacted": "SimpleNamespace"} == dump["sampling_params"]


def test_getattr_failure_becomes_that_fields_error() -> None:
    """A field whose value cannot be read says so; the other fields are still dumped."""
    request = make_request()
    del request.block_ids
    dump = dump_object(request)
    assert "AttributeError" in dump["block_ids"]["error"]
    assert "req-0" == dump["request_id"]


def test_long_lists_are_cut_with_their_total() -> None:
    """A list of safe numbers longer than MAX_LIST_ITEMS keeps its head and says its total."""
    dump = dump_object(make_request(block_ids=list(range(10_000))))
    assert 10_000 == dump["block_ids"]["total"]
    assert redaction.MAX_LIST_ITEMS == len(dump["block_ids"]["first"])


# ---- the three parts ---------------------------------------------------------------------


def test_scheduler_output_part_of_a_real_step() -> None:
    """A real scheduler step: per request its id, counts, scheduled tokens and blocks; batch
    totals; the model input as shapes only."""
    step = real_step(3, [20, 33, 40], num_blocks=64)
    model_input = prepare_model_input(step.step_id, step.chunks, 16, {})
    part = scheduler_output_part(step, model_input)
    assert {
        "step_id": 1,
        "num_requests": 3,
        "num_scheduled_tokens": 93,
        "num_prefill_chunks": 3,
        "num_omitted_requests": 0,
    }.items() <= part.items()
    assert ["req-0", "req-1", "req-2"] == [r["request_id"] for r in part["requests"]]
    assert [20, 33, 40] == [r["num_scheduled_tokens"] for r in part["requests"]]
    assert [2, 3, 3] == [r["num_blocks"] for r in part["requests"]]
    assert {"shape": [93], "dtype": "int64", "device": "cpu"} == part["tensors"]["input_ids"]
    # The block tables are int64 in torch's ops and int32 in the compiled kernels (issue 24).
    assert "int64" == part["tensors"]["block_tables"]["dtype"]
    with_kernels = scheduler_output_part(step, model_input, kernels=True)
    assert "int32" == with_kernels["tensors"]["block_tables"]["dtype"]
    assert [3, 3] == part["tensors"]["block_tables"]["shape"]
    assert numbers_in(part).isdisjoint(CANARY_IDS)


def test_scheduler_output_part_without_a_step() -> None:
    """Outside a step the part says that no step was running."""
    assert {"step_id": None, "requests": [], "note": "no step was running"} == (
        scheduler_output_part(None)
    )


def test_engine_config_part_names_model_parallelism_limits_and_versions() -> None:
    """Model basename (never the full path), TP size, cache and scheduler limits, versions."""
    config = EngineConfig.from_kwargs(
        model="/secret/dir/tiny-llama", tensor_parallel_size=2, num_kv_blocks=100
    )
    arch = SimpleNamespace(
        architecture="LlamaForCausalLM",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    part = engine_config_part(config, arch)
    assert {
        "model": "tiny-llama",
        "tensor_parallel_size": 2,
        "num_kv_blocks": 100,
        "block_size": 16,
        "kv_cache_dtype": "auto",
        "architecture": "LlamaForCausalLM",
    }.items() <= part.items()
    assert {"otel_engine", "torch", "python"} == set(part["versions"])
    assert "/secret" not in to_json(part)


def test_engine_config_part_says_which_fast_paths_ran() -> None:
    """Each rank's fast-path decisions the model ran with (which kernels a native fault was
    in), and where the ranks differ."""
    summary = {
        "cpu_isa": "avx512bf16",
        "kernel_isa": "avx512bf16",
        "paths": {"int4_kernels": {"enabled": True, "reason": "the checkpoint's 4-bit weights"}},
    }
    plans = rank_plans([summary, {**summary, "cpu_isa": "avx2"}])

    part = engine_config_part(EngineConfig(), fast_paths=plans)

    assert [summary, {**summary, "cpu_isa": "avx2"}] == part["fast_paths"]["ranks"]
    assert (True, [{"key": "cpu_isa", "values": ["avx512bf16", "avx2"]}]) == (
        part["fast_paths"]["ranks_differ"],
        part["fast_paths"]["differences"],
    )
    assert "fast_paths" not in engine_config_part(EngineConfig())


def test_system_stats_part_survives_a_broken_scheduler() -> None:
    """Each stat that cannot be read says why; the failure and the rest are still there."""
    failure = failure_summary("otel-worker-1", "RuntimeError", "boom", "exception", rank=1)
    part = system_stats_part(
        scheduler=SimpleNamespace(),
        started_at=0.0,
        last_step_at=0.0,
        failure=failure,
        process_pids={"engine_core": 2**22 + 12345, "gone": None},
    )
    assert failure == part["failure"]
    assert "AttributeError" in part["num_running"]["error"]
    assert {"engine_core"} == set(part["process_rss_mib"])


def test_system_stats_part_has_the_prefix_cache_state() -> None:
    """The cache's hit rate since start (prompt tokens) and its cached free blocks."""
    scheduler = Scheduler(
        BlockAllocator(8, 4), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32
    )
    scheduler.allocator.record_lookup(10, 4)
    part = system_stats_part(
        scheduler=scheduler,
        started_at=0.0,
        last_step_at=0.0,
        failure=failure_summary("engine_core", "RuntimeError", "boom", "exception"),
        process_pids={},
    )

    assert (0.4, 0, 8) == (
        part["prefix_cache_hit_rate"],
        part["num_cached_kv_blocks"],
        part["num_free_kv_blocks"],
    )


@pytest.mark.parametrize(
    ("info", "rank"),
    [
        (ErrorInfo(type="T", message="m", process="otel-worker-3", rank=3), 3),
        (ErrorInfo(type="T", message="m", process="engine_core"), None),
        # the rank is a field of its own: a name is never parsed back into one
        (ErrorInfo(type="T", message="m", process="otel-worker-3"), None),
    ],
)
def test_the_failed_rank_is_the_error_s_own_field(info: ErrorInfo, rank: int | None) -> None:
    """Issue 24: the dump's rank is `ErrorInfo.rank`, set where a worker's failure is
    built (its report, its death, the hung rank), not parsed from the process name."""
    from otel_engine.observability.crash_delivery import failure_of

    assert rank == failure_of(info)["rank"]


def test_failing_part_becomes_its_error_and_the_rest_is_written() -> None:
    """A part that raises is replaced by its error's type and message."""

    def broken() -> Any:
        raise KeyError("no such thing")

    dump = build_dump({"scheduler_output": broken, "engine_config": lambda: {"a": 1}})
    assert "KeyError" in dump["scheduler_output"]["error"]
    assert {"a": 1} == dump["engine_config"]
    assert dump["build_ms"] >= 0


def test_256_requests_in_flight_fit_under_the_cap() -> None:
    """256 requests of 128-2048 prompt tokens (up to 128 blocks each): the dump is under
    MAX_DUMP_BYTES, and every request is either listed or counted as omitted."""
    rng = random.Random(0)
    lengths = [rng.randint(128, 2048) for _ in range(256)]
    step = real_step(256, lengths, num_blocks=sum(lengths) // 16 + 256)
    model_input = prepare_model_input(step.step_id, step.chunks, 16, {})
    dump = build_dump({"scheduler_output": lambda: scheduler_output_part(step, model_input)})
    part = dump["scheduler_output"]
    assert len(to_json(dump).encode()) <= MAX_DUMP_BYTES
    assert 256 == part["num_requests"] == len(part["requests"]) + part["num_omitted_requests"]


# ---- delivery ----------------------------------------------------------------------------


class ListHandler(logging.Handler):
    """Keeps records and their rendering by the real JSON pipeline (as on stderr)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.lines: list[str] = []
        chain = shared_processors("engine_core", None, log_prompts=False)
        self.renderer = PipelineFormatter(chain, [remove_meta, structure_exception, render_json])

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.renderer.format(record))


@pytest.fixture
def capture() -> Any:
    """A logger of its own whose records are kept and rendered as JSON lines."""
    logger = logging.getLogger(f"tests.crash_dump.{uuid.uuid4().hex}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = ListHandler()
    logger.addHandler(handler)
    yield SimpleNamespace(logger=logger, handler=handler)
    logger.removeHandler(handler)


@pytest.fixture
def tracer_and_spans() -> Any:
    """A tracer of a private SDK provider and the in-memory exporter of its spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("tests"), exporter
    provider.shutdown()


def a_dump() -> dict[str, Any]:
    step = real_step(2, [10, 20], num_blocks=16)
    return build_dump(
        {
            "scheduler_output": lambda: scheduler_output_part(step),
            "engine_config": lambda: engine_config_part(EngineConfig()),
            "system_stats": lambda: {"num_running": 2},
        }
    )


def test_report_crash_adds_the_crash_event_next_to_exception(
    capture: Any, tracer_and_spans: Any
) -> None:
    """On a real span: an `exception` event, then `otel_engine.crash` with the three parts
    as JSON strings, the failed rank and reason; status ERROR."""
    tracer, exporter = tracer_and_spans
    dump = a_dump()
    failure = failure_summary("otel-worker-1", "InjectedFault", "boom", "exception", rank=1)
    span = tracer.start_span("engine_core.step")
    report_crash(dump, span, failure, capture.logger)
    span.end()
    (finished,) = exporter.get_finished_spans()
    assert ["exception", "otel_engine.crash"] == [e.name for e in finished.events]
    attributes = finished.events[1].attributes
    assert {part: dump[part] for part in PARTS} == {
        part: strict_json(attributes[f"otel_engine.crash.{part}"]) for part in PARTS
    }
    assert 1 == attributes["otel_engine.crash.failed_rank"]
    assert "InjectedFault: boom" == attributes["otel_engine.crash.reason"]
    assert "ERROR" == finished.status.status_code.name


def test_report_crash_logs_one_json_line_with_nested_parts(
    capture: Any, tracer_and_spans: Any
) -> None:
    """One CRITICAL `engine_crash_dump` record; its JSON line holds the parts as objects and
    the span's trace and span ids."""
    tracer, _ = tracer_and_spans
    dump = a_dump()
    span = tracer.start_span("engine_core.step")
    report_crash(dump, span, failure_summary("engine_core", "E", "m", "exception"), capture.logger)
    (line,) = [strict_json(text) for text in capture.handler.lines]
    assert ("engine_crash_dump", "critical") == (line["event"], line["level"])
    assert {part: dump[part] for part in PARTS} == {part: line[part] for part in PARTS}
    assert format(span.get_span_context().span_id, "016x") == line["span_id"]


FAULT_FRAMES = [
    SimpleNamespace(function="string_at", file="ctypes/__init__.py", line=519),
    SimpleNamespace(function="maybe_inject", file="otel_engine/observability/faults.py", line=9),
]


def test_failure_summary_of_a_native_fault_has_the_signal_and_frames() -> None:
    """A process that died of a signal: its name and at most MAX_FAULT_FRAMES frames as
    {function, file, line}, innermost first; any other failure: no signal, no frames."""
    frames = FAULT_FRAMES * 20
    failure = failure_summary(
        "otel-worker-1", "WorkerDied", "m", "died", signal="SIGSEGV", frames=frames
    )
    plain = failure_summary("engine_core", "RuntimeError", "boom", "exception")

    assert "SIGSEGV" == failure["signal"]
    assert crash_dump.MAX_FAULT_FRAMES == len(failure["frames"])
    assert {"function": "string_at", "file": "ctypes/__init__.py", "line": 519} == failure[
        "frames"
    ][0]
    assert (None, []) == (plain["signal"], plain["frames"])


def test_report_crash_of_a_native_fault_puts_signal_and_frames_on_span_and_line(
    capture: Any, tracer_and_spans: Any
) -> None:
    """The crash event gets `otel_engine.crash.signal` and `.frames` (JSON), the log line
    `signal` and `frames`, equal to the failure part's."""
    tracer, exporter = tracer_and_spans
    failure = failure_summary(
        "engine_core", "EngineCoreDied", "m", "died", signal="SIGSEGV", frames=FAULT_FRAMES
    )
    span = tracer.start_span("engine_core.crash")
    report_crash(a_dump(), span, failure, capture.logger)
    span.end()

    (finished,) = exporter.get_finished_spans()
    attributes = finished.events[1].attributes
    (line,) = [strict_json(text) for text in capture.handler.lines]
    assert "SIGSEGV" == attributes["otel_engine.crash.signal"] == line["signal"]
    assert failure["frames"] == strict_json(attributes["otel_engine.crash.frames"])
    assert failure["frames"] == line["frames"]


def test_front_end_stats_part_says_what_it_cannot_know() -> None:
    """After the engine core died: the failure, uptime and the machine's load; the
    scheduler's state marked not available."""
    failure = failure_summary("engine_core", "EngineCoreDied", "m", "died", signal="SIGSEGV")

    part = crash_dump.front_end_stats_part(failure=failure, started_at=0.0)

    assert failure == part["failure"]
    assert "not_available" in part["scheduler"]
    assert {"uptime_s", "process_rss_mib", "cpu_count", "load_average"} <= set(part)
    assert "not_available" in to_json(crash_dump.not_available("gone"))


def test_report_crash_without_a_span_still_logs(capture: Any) -> None:
    """Tracing off (span None): the log line is still written, without trace ids."""
    failure = failure_summary("engine_core", "E", "m", "exception")
    report_crash(a_dump(), None, failure, capture.logger)
    (line,) = [strict_json(text) for text in capture.handler.lines]
    assert "engine_crash_dump" == line["event"]
    assert "span_id" not in line


class ExplodingSpan:
    """A span whose every method raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"span.{name} exploded")


class ExplodingLogger:
    """A logger whose every method raises."""

    def __getattr__(self, name: str) -> Any:
        def explode(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"logger.{name} exploded")

        return explode


def test_report_crash_never_raises_when_span_and_logger_fail() -> None:
    """A span and a logger that both raise: report_crash returns normally."""
    report_crash(a_dump(), ExplodingSpan(), {"type": "E"}, ExplodingLogger())


def test_a_failing_span_does_not_stop_the_log_line(capture: Any) -> None:
    """A span that raises: the `engine_crash_dump` log line is still written."""
    report_crash(a_dump(), ExplodingSpan(), {"type": "E"}, capture.logger)
    assert "engine_crash_dump" in [r.getMessage() for r in capture.handler.records]


# ---- Hypothesis: hostile input -----------------------------------------------------------
#
# The strategies generate everything the contract names: odd values, missing fields, huge
# lists, objects whose repr/str/len/getattr raise, NaN/inf, deep nesting, cycles, unknown
# types, huge ints, non-string keys, cycles; the output is strict JSON (no NaN/Infinity).
NON_STR_INTS = True  # ints too long for str() are generated too
STRICT_JSON = True  # non-finite floats never reach the JSON text


class Boom(Exception):
    """Raised by every hostile dunder."""


class Hostile:
    """An object whose repr, str, len, bool, iteration, comparison and getattr raise."""

    def __repr__(self) -> str:
        raise Boom("repr")

    def __str__(self) -> str:
        raise Boom("str")

    def __len__(self) -> int:
        raise Boom("len")

    def __bool__(self) -> bool:
        raise Boom("bool")

    def __iter__(self) -> Any:
        raise Boom("iter")

    def __eq__(self, other: object) -> bool:
        raise Boom("eq")

    def __hash__(self) -> int:
        raise Boom("hash")

    def __getattr__(self, name: str) -> Any:
        raise Boom(f"getattr {name}")


class HostileWithPolicy(Hostile):
    """Hostile, but it declares a policy, so the dumper reads its fields (which raise)."""

    __crash_dump__: ClassVar[dict[str, str]] = {"x": "value", "y": "count", "z": "nested"}

    def __init__(self) -> None:
        self.__dict__.update(x=1, y=[1], z=self, prompt=CANARY)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__"):
            return object.__getattribute__(self, name)
        raise Boom(f"getattribute {name}")


class BadPolicy:
    """A type whose policy has an unknown rule and a rule that raises."""

    __crash_dump__: ClassVar[dict[str, Any]] = {
        "a": "no-such-rule",
        "b": lambda value: 1 / 0,
        "c": "is_set",
        "d": "count",
    }

    def __init__(self, value: Any) -> None:
        self.a = self.b = self.c = self.d = value
        self.e = CANARY


class BrokenStr(str):
    """A str whose str() raises."""

    def __str__(self) -> str:
        raise Boom("str")


def huge_int() -> int:
    """An int too long for str() (over sys.get_int_max_str_digits())."""
    return 10**5000


def deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def cyclic(_: int) -> Any:
    value: list[Any] = [1]
    value.append(value)
    return value


INTS = st.one_of(st.integers(), st.integers(min_value=-(2**300), max_value=2**300))
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.one_of(INTS, st.builds(huge_int)) if NON_STR_INTS else INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.text(st.characters(exclude_categories=()), max_size=300),
    st.text(max_size=2000).map(BrokenStr),
    st.binary(max_size=64),
    st.complex_numbers(),
    st.sampled_from(list(RequestStatus)),
    st.builds(Hostile),
    st.builds(HostileWithPolicy),
    st.builds(object),
)
PLAIN = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.frozensets(st.integers(), max_size=6),
    ),
    max_leaves=12,
)
ODD = st.one_of(
    PLAIN,
    st.dictionaries(st.one_of(st.integers(), st.tuples(st.integers())), PLAIN, max_size=3),
    st.integers(0, 50_000).map(lambda n: list(range(n))),
    st.integers(0, 3_000).map(deep),
    st.builds(cyclic, st.integers()),
    st.builds(BadPolicy, SCALARS),
)
PART_VALUES = st.one_of(  # what a part may return: no cycles, bounded nesting, str keys
    PLAIN,
    st.integers(0, 50_000).map(lambda n: {"pids": list(range(n))}),
    st.integers(0, 200).map(deep),
    st.builds(BadPolicy, SCALARS),
)
ODD_PARAMS = st.builds(
    SamplingParams,
    max_tokens=ODD,
    temperature=ODD,
    top_p=ODD,
    top_k=ODD,
    seed=ODD,
    stop=st.one_of(ODD, st.lists(st.text(), max_size=3).map(tuple)),
    stop_token_ids=ODD,
)


@st.composite
def odd_requests(draw: st.DrawFn) -> Request:
    """A real Request with odd values in any field, some fields missing."""
    names = [f.name for f in dataclasses.fields(Request)]
    values = {name: draw(ODD) for name in names}
    values["sampling_params"] = draw(st.one_of(ODD_PARAMS, ODD))
    request = Request(**values)
    for name in draw(st.sets(st.sampled_from(names), max_size=3)):
        delattr(request, name)
    return request


@st.composite
def odd_steps(draw: st.DrawFn) -> Any:
    """A step: a real SchedulerOutput of odd chunks, or a look-alike with fields missing."""
    chunk = st.one_of(
        st.builds(ScheduledChunk, odd_requests(), ODD, ODD),
        st.builds(ScheduledChunk, odd_requests(), st.integers(0, 10), st.integers(1, 10)),
        st.builds(SimpleNamespace, request=odd_requests()),
        ODD,
    )
    chunks = draw(st.one_of(st.lists(chunk, max_size=5), ODD))
    # step_id and preempted_request_ids are copied into the part as they are, so they get
    # part values (no cycles; see test_unserializable_part_becomes_its_error).
    step_id, preempted = draw(PART_VALUES), draw(PART_VALUES)
    if draw(st.booleans()):
        return SchedulerOutput(step_id=step_id, chunks=chunks, preempted_request_ids=preempted)
    fields = {"step_id": step_id, "chunks": chunks, "preempted_request_ids": preempted}
    kept = draw(st.sets(st.sampled_from(sorted(fields))))
    return SimpleNamespace(**{k: v for k, v in fields.items() if k in kept})


def fits(value: Any) -> None:
    """`value` renders to JSON under the cap (strict RFC 8259 JSON once STRICT_JSON)."""
    text = to_json(value)
    strict_json(text) if STRICT_JSON else json.loads(text)
    assert len(text.encode()) <= MAX_DUMP_BYTES


@HYPOTHESIS
@given(odd_requests())
def test_dump_object_of_any_request_never_raises(request_: Request) -> None:
    """A Request with any odd or missing fields dumps to JSON without raising, and nothing
    outside its policy (here: the canary in the hostile objects) gets through."""
    dump = dump_object(request_)
    fits(dump)
    assert CANARY not in to_json(dump)


@HYPOTHESIS
@given(ODD)
def test_dump_object_of_anything_never_raises(value: Any) -> None:
    """Any value at all (unknown types, hostile objects, bad policies) dumps without raising."""
    fits(dump_object(value))


@HYPOTHESIS
@given(odd_steps(), st.one_of(st.none(), ODD))
def test_scheduler_output_part_of_any_step_never_raises(step: Any, model_input: Any) -> None:
    """Any step (odd chunks, missing fields, hostile objects), dumped as the engine does it
    (through build_dump), gives a part or its error, never an exception."""
    dump = build_dump({"scheduler_output": lambda: scheduler_output_part(step, model_input)})
    fits(dump)
    assert set(dump) <= {"scheduler_output", "build_ms", "truncated"}


@HYPOTHESIS
@given(odd_steps(), PART_VALUES, PART_VALUES)
def test_build_dump_never_raises_and_stays_under_the_cap(
    step: Any, config_part: Any, stats_part: Any
) -> None:
    """Whatever the parts return or raise, build_dump returns JSON under the cap."""

    def raising() -> Any:
        raise Boom("part")

    dump = build_dump(
        {
            "scheduler_output": lambda: scheduler_output_part(step),
            "engine_config": lambda: config_part,
            "system_stats": lambda: stats_part,
            "extra": raising,
        }
    )
    fits(dump)


@HYPOTHESIS
@given(odd_steps(), st.dictionaries(st.text(max_size=8), PART_VALUES, max_size=5))
def test_report_crash_never_raises(step: Any, failure: dict[str, Any]) -> None:
    """report_crash on a real span, a failing span and no span, with a real and a failing
    logger and an odd failure, never raises; what reaches the real span parses as JSON."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    logger = logging.getLogger("tests.crash_dump.hypothesis")
    logger.propagate = False
    logger.handlers[:] = [ListHandler()]
    dump = build_dump({"scheduler_output": lambda: scheduler_output_part(step)})
    span = provider.get_tracer("tests").start_span("engine_core.step")
    for target in (span, ExplodingSpan(), None):
        report_crash(dump, target, failure, logger)
        report_crash(dump, target, failure, ExplodingLogger())
    span.end()
    events = [e for e in exporter.get_finished_spans()[0].events if e.name == "otel_engine.crash"]
    for event in events:
        for part in PARTS:
            fits(json.loads(event.attributes[f"otel_engine.crash.{part}"]))
    provider.shutdown()


def test_msgspec_struct_policy_is_read_from_struct_fields() -> None:
    """Struct fields are found through `__struct_fields__` (not `__dict__`)."""

    class Tiny(msgspec.Struct):
        num: int
        secret: str
        __crash_dump__: ClassVar[dict[str, str]] = {"num": "value"}

    assert {"num": 1, "unlisted_fields": {"secret": "str"}} == dump_object(Tiny(1, CANARY))


# ---- hostile parts: each once was a bug -------------------------------------------------


def test_non_finite_floats_are_written_as_json() -> None:
    """A NaN or infinite value in a dumped field still gives RFC 8259 JSON."""
    request = make_request(arrival_time=math.nan, first_scheduled_time=math.inf)
    strict_json(to_json(build_dump({"scheduler_output": lambda: dump_object(request)})))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda: {"num_computed_tokens": huge_int()}, id="int-over-4300-digits"),
        pytest.param(lambda: cyclic(0), id="cycle"),
        pytest.param(lambda: deep(100_000), id="deeper-than-the-recursion-limit"),
        pytest.param(lambda: {(1, 2): 3}, id="tuple-key"),
    ],
)
def test_unserializable_part_becomes_its_error(value: Callable[[], Any]) -> None:
    """A part whose value cannot be written as JSON is replaced by an error; build_dump
    does not raise and the other parts are kept."""
    dump = build_dump({"engine_config": value, "system_stats": lambda: {"num_running": 1}})
    fits(dump)
    assert {"num_running": 1} == dump["system_stats"]


def test_oversized_part_is_cut_and_the_other_parts_kept() -> None:
    """One part too big for the cap (a long pid list) does not take the others with it."""
    dump = build_dump(
        {
            "scheduler_output": lambda: scheduler_output_part(real_step(2, [8, 8], 8)),
            "engine_config": lambda: {"model": "tiny"},
            "system_stats": lambda: {"process_rss_mib": {str(i): 1.0 for i in range(20_000)}},
        }
    )
    fits(dump)
    assert {"model": "tiny"} == dump["engine_config"]
    assert 2 == dump["scheduler_output"]["num_requests"]


def test_scheduler_output_part_of_a_malformed_step_does_not_raise() -> None:
    """A step without chunks, or with a chunk whose token count is not a number, gives a
    part that says so."""
    no_chunks = scheduler_output_part(SimpleNamespace(step_id=1))
    bad_count = scheduler_output_part(
        SimpleNamespace(step_id=1, chunks=[SimpleNamespace(num_tokens="x")])
    )

    assert {"error"} == set(no_chunks)
    assert no_chunks["error"].startswith("AttributeError")
    assert {"error"} == set(bad_count)
    assert bad_count["error"].startswith("TypeError")


def test_dump_object_of_an_unlistable_object_does_not_raise() -> None:
    """A type with a policy whose instances have no __dict__ (only private slots)."""

    class Slotted:
        __slots__ = ("_secret",)
        __crash_dump__: ClassVar[dict[str, str]] = {}

    slotted = Slotted()
    slotted._secret = "prompt text"

    assert {} == dump_object(slotted)
