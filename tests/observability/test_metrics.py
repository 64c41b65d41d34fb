"""Prometheus metrics: every `otel_engine_*` family, per-step and per-request updates, OTLP."""

from __future__ import annotations

import enum

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_engine.config import ObservabilityConfig
from otel_engine.executor.rank_plans import rank_plans
from otel_engine.ipc.messages import StepOutputs
from otel_engine.observability.label_sets import (
    ConnectionCloseReason,
    InvalidJsonReason,
    ToolCallOutcome,
)
from otel_engine.observability.metrics import TTFT_BUCKETS, VLLM_NAMES, EngineMetrics
from otel_engine.observability.otlp_metrics import registry_to_metrics, start_otlp_metrics
from otel_engine.observability.tracing import shutdown_telemetry
from otel_engine.outputs import FinishReason
from tests.helpers.otlp_receiver import OtlpReceiver

FAMILIES = {
    "otel_engine_requests_running": "gauge",
    "otel_engine_requests_waiting": "gauge",
    "otel_engine_requests_paused": "gauge",
    "otel_engine_frontend_requests": "gauge",
    "otel_engine_ignored_request_fields": "counter",
    "otel_engine_http_connections": "gauge",
    "otel_engine_http_connections_closed": "counter",
    "otel_engine_kv_cache_usage_ratio": "gauge",
    "otel_engine_kv_cache_cached_blocks": "gauge",
    "otel_engine_cache_config_info": "gauge",
    "otel_engine_prefix_cache_queries": "counter",
    "otel_engine_prefix_cache_hits": "counter",
    "otel_engine_prompt_tokens": "counter",
    "otel_engine_generation_tokens": "counter",
    "otel_engine_request_success": "counter",
    "otel_engine_request_errors": "counter",
    "otel_engine_time_to_first_token_seconds": "histogram",
    "otel_engine_time_per_output_token_seconds": "histogram",
    "otel_engine_e2e_request_latency_seconds": "histogram",
    "otel_engine_request_queue_time_seconds": "histogram",
    "otel_engine_request_prompt_tokens": "histogram",
    "otel_engine_request_generation_tokens": "histogram",
    "otel_engine_step_duration_seconds": "histogram",
    "otel_engine_step_batch_size": "histogram",
    "otel_engine_step_tokens": "histogram",
    "otel_engine_preemptions": "counter",
    "otel_engine_grammar_compile_seconds": "histogram",
    "otel_engine_telemetry_export_failures": "counter",
    "otel_engine_structured_output_invalid": "counter",
    "otel_engine_tool_calls": "counter",
    "otel_engine_engine_health_state": "gauge",
    "otel_engine_engine_restarts": "counter",
    "otel_engine_requests_migrated": "counter",
    "otel_engine_tokens_recomputed": "counter",
    "otel_engine_engine_recovery_seconds": "histogram",
    "otel_engine_requests_poisoned": "counter",
    "otel_engine_fast_path_info": "gauge",
    "otel_engine_step_grammar_mask_seconds": "histogram",
    "otel_engine_grammar_deferred": "counter",
    "otel_engine_memory_read_bandwidth_bytes_per_second": "gauge",
    "otel_engine_decode_bandwidth_bytes_per_second": "gauge",
    "otel_engine_decode_bandwidth_ratio": "gauge",
}


FAST_PATHS = rank_plans(  # every rank's FastPaths.summary(), as the engine reports them
    [
        {
            "cpu_isa": "avx2",
            "kernel_isa": None,
            "paths": {
                "compiled_kernels": {"enabled": False, "reason": "float32 on avx2"},
                "onednn_packing": {"enabled": True, "reason": "oneDNN prepacked weights"},
            },
        },
        {
            "cpu_isa": "avx512bf16",
            "kernel_isa": "avx512bf16",
            "paths": {
                "compiled_kernels": {"enabled": True, "reason": None},
                "onednn_packing": {"enabled": True, "reason": "oneDNN prepacked weights"},
            },
        },
    ]
)


class Step:
    """StepOutputs plus the optional per-step cost fields `on_step` reads when present."""

    num_running = 3
    num_waiting = 2
    kv_cache_usage = 0.25
    num_preemptions = 1
    step_duration_s = 0.012
    num_scheduled_seqs = 5
    num_scheduled_tokens = 130


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text, keyed by (name, sorted labels)."""
    body, _ = metrics.render()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def finish_one(metrics: EngineMetrics) -> None:
    metrics.on_request_finished(
        finish_reason="stop",
        num_prompt_tokens=12,
        num_generation_tokens=5,
        e2e_s=0.9,
        queue_s=0.05,
        ttft_s=0.1,
    )


def test_render_has_every_family_with_its_type() -> None:
    """GET /metrics text lists every family of the telemetry contract with the right type."""
    body, content_type = EngineMetrics().render()
    assert content_type.startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert FAMILIES == {name: families.get(name) for name in FAMILIES}


def test_finished_request_moves_counters_and_histograms() -> None:
    """One finished request counts tokens and success and lands in each latency histogram."""
    metrics = EngineMetrics()
    finish_one(metrics)
    values = samples(metrics)
    assert 12 == values[("otel_engine_prompt_tokens_total", ())]
    assert 5 == values[("otel_engine_generation_tokens_total", ())]
    assert 1 == values[("otel_engine_request_success_total", (("finish_reason", "stop"),))]
    for name in (
        "otel_engine_time_to_first_token_seconds",
        "otel_engine_time_per_output_token_seconds",
        "otel_engine_e2e_request_latency_seconds",
        "otel_engine_request_queue_time_seconds",
        "otel_engine_request_prompt_tokens",
    ):
        assert 1 == values[(f"{name}_count", ())], name


def test_tpot_is_derived_from_ttft_and_e2e() -> None:
    """Without tpot_s, TPOT = (e2e - ttft) / (generated - 1)."""
    metrics = EngineMetrics()
    finish_one(metrics)
    assert (
        pytest.approx(0.2)
        == samples(metrics)[("otel_engine_time_per_output_token_seconds_sum", ())]
    )


def test_ttft_uses_the_genai_bucket_boundaries() -> None:
    """TTFT buckets are those of gen_ai.server.time_to_first_token (1 ms ... 10 s)."""
    values = samples(EngineMetrics())
    bounds = sorted(
        float(dict(labels)["le"])
        for name, labels in values
        if name == "otel_engine_time_to_first_token_seconds_bucket"
    )
    assert [*TTFT_BUCKETS, float("inf")] == bounds
    assert 0.001 == TTFT_BUCKETS[0]
    assert 10.0 == TTFT_BUCKETS[-1]


def test_on_step_sets_gauges_and_step_histograms() -> None:
    """A step sets running/waiting/KV usage, counts preemptions, observes step cost."""
    metrics = EngineMetrics()
    metrics.on_step(Step())
    values = samples(metrics)
    assert (3, 2, 0.25, 1) == (
        values[("otel_engine_requests_running", ())],
        values[("otel_engine_requests_waiting", ())],
        values[("otel_engine_kv_cache_usage_ratio", ())],
        values[("otel_engine_preemptions_total", ())],
    )
    assert pytest.approx(0.012) == values[("otel_engine_step_duration_seconds_sum", ())]
    assert 5 == values[("otel_engine_step_batch_size_sum", ())]
    assert 130 == values[("otel_engine_step_tokens_sum", ())]


def test_on_step_accepts_step_outputs() -> None:
    """The engine's StepOutputs message works as it is (the optional fields are skipped)."""
    metrics = EngineMetrics()
    metrics.on_step(StepOutputs(step_id=4, updates=[], num_running=1, kv_cache_usage=0.5))
    assert 0.5 == samples(metrics)[("otel_engine_kv_cache_usage_ratio", ())]


def test_structured_rows_a_step_deferred_are_counted() -> None:
    metrics = EngineMetrics()
    for _ in range(2):
        metrics.on_step(StepOutputs(step_id=5, updates=[], num_grammar_deferred=3))
    assert 6 == samples(metrics)[("otel_engine_grammar_deferred_total", ())]


def test_prefix_cache_lookups_count_in_every_frame() -> None:
    """Queried and found prompt tokens add up over frames, no-step frames included; the
    cached-block gauge follows the last frame."""
    metrics = EngineMetrics()
    metrics.on_step(
        StepOutputs(
            step_id=1,
            updates=[],
            prefix_cache_queries=100,
            prefix_cache_hits=64,
            kv_cache_cached_blocks=9,
        )
    )
    metrics.on_step(
        StepOutputs(step_id=0, updates=[], prefix_cache_queries=20, kv_cache_cached_blocks=7)
    )
    values = samples(metrics)

    assert (120, 64, 7) == (
        values[("otel_engine_prefix_cache_queries_total", ())],
        values[("otel_engine_prefix_cache_hits_total", ())],
        values[("otel_engine_kv_cache_cached_blocks", ())],
    )


def test_errors_are_counted_by_type() -> None:
    """Each error type gets its own series; tokens of failed requests still count."""
    metrics = EngineMetrics()
    metrics.on_request_error("engine_dead", num_prompt_tokens=7)
    metrics.on_request_error("engine_dead")
    metrics.on_request_error("abort")
    values = samples(metrics)
    assert 2 == values[("otel_engine_request_errors_total", (("error_type", "engine_dead"),))]
    assert 1 == values[("otel_engine_request_errors_total", (("error_type", "abort"),))]
    assert 7 == values[("otel_engine_prompt_tokens_total", ())]


def test_fast_path_decisions_are_one_sample_each() -> None:
    """Each path of each rank's start-up decision is one sample of value 1 whose labels say
    the rank, whether it runs there and on which instruction sets."""
    metrics = EngineMetrics()
    metrics.set_fast_paths(FAST_PATHS)

    found = {
        (labels["path"], labels["rank"]): (labels["enabled"], labels["cpu_isa"], value)
        for (name, label_items), value in samples(metrics).items()
        if name == "otel_engine_fast_path_info"
        for labels in [dict(label_items)]
    }
    assert {
        ("compiled_kernels", "0"): ("false", "avx2", 1.0),
        ("onednn_packing", "0"): ("true", "avx2", 1.0),
        ("compiled_kernels", "1"): ("true", "avx512bf16", 1.0),
        ("onednn_packing", "1"): ("true", "avx512bf16", 1.0),
    } == found


def test_health_state_is_one_hot() -> None:
    """Exactly the current health state is 1."""
    metrics = EngineMetrics()
    metrics.set_health("dead")
    values = samples(metrics)
    states = {
        dict(labels)["state"]: value
        for (name, labels), value in values.items()
        if name == "otel_engine_engine_health_state"
    }
    assert {
        "starting": 0,
        "healthy": 0,
        "draining": 0,
        "stalled": 0,
        "recovering": 0,
        "dead": 1,
    } == states


def test_restarts_in_place_are_counted_from_zero() -> None:
    """The failures with no exception of their own exist at 0 before the first restart, so
    that `increase()` sees it; an exception's class appears when it happens."""
    metrics = EngineMetrics()
    before = samples(metrics)
    assert 0 == before[("otel_engine_engine_restarts_total", (("cause", "EngineCoreDied"),))]

    metrics.on_engine_restart("InjectedFault")
    metrics.on_requests_migrated(3, 420)
    metrics.on_stream_recovered(2.5)
    metrics.on_request_poisoned()
    values = samples(metrics)

    assert 1 == values[("otel_engine_engine_restarts_total", (("cause", "InjectedFault"),))]
    assert 3 == values[("otel_engine_requests_migrated_total", ())]
    assert 420 == values[("otel_engine_tokens_recomputed_total", ())]
    assert 1 == values[("otel_engine_engine_recovery_seconds_count", ())]
    assert 1 == values[("otel_engine_requests_poisoned_total", ())]


def test_unknown_health_state_is_rejected() -> None:
    """A typo in a state name fails instead of adding a series."""
    with pytest.raises(ValueError, match="health state"):
        EngineMetrics().set_health("ok")


def test_two_servers_do_not_share_a_registry() -> None:
    """Each EngineMetrics has a private registry: two in one process never collide."""
    first, second = EngineMetrics(), EngineMetrics()
    finish_one(first)
    assert 0 == samples(second)[("otel_engine_prompt_tokens_total", ())]


def test_histograms_convert_to_otlp_bucket_counts() -> None:
    """Prometheus cumulative buckets become OTLP per-bucket counts with finite bounds."""
    metrics = EngineMetrics()
    for value in (0.0005, 0.05, 0.05, 20.0):
        metrics.time_to_first_token.observe(value)
    converted = {m.name: m for m in registry_to_metrics(metrics.registry, 0)}
    point = converted["otel_engine_time_to_first_token_seconds"].data.data_points[0]
    assert list(TTFT_BUCKETS) == list(point.explicit_bounds)
    assert len(TTFT_BUCKETS) + 1 == len(point.bucket_counts)
    assert (4, 1, 2, 1) == (
        point.count,
        point.bucket_counts[0],
        point.bucket_counts[TTFT_BUCKETS.index(0.06)],
        point.bucket_counts[-1],
    )


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_export_of_the_registry(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an endpoint, the same families reach an OTLP receiver (final export at shutdown)."""
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "60000")
    metrics = EngineMetrics()
    finish_one(metrics)
    metrics.on_request_error("abort")
    metrics.set_fast_paths(FAST_PATHS)
    metrics.set_cache_config(block_size=16, num_blocks=64, prefix_caching=False)
    with OtlpReceiver(protocol) as receiver:
        config = ObservabilityConfig(otlp_endpoint=receiver.endpoint, otlp_protocol=protocol)
        bridge = start_otlp_metrics(metrics.registry, config=config, instance_id="engine-m")
        assert bridge is not None
        assert shutdown_telemetry(10)
        exported = {m["name"]: m for m in receiver.metrics()}
    assert set(FAMILIES) == set(exported)
    success = exported["otel_engine_request_success"]
    assert ("sum", {"finish_reason": "stop"}, 1) == (
        success["kind"],
        success["points"][0]["attributes"],
        success["points"][0]["value"],
    )
    assert 1 == exported["otel_engine_time_to_first_token_seconds"]["points"][0]["count"]
    assert "api_server" == success["resource"]["otel_engine.process.role"]


def test_no_metrics_endpoint_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an endpoint, no OTLP metrics thread starts."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", raising=False)
    assert start_otlp_metrics(EngineMetrics().registry, config=ObservabilityConfig()) is None


def test_engine_errors_exist_at_zero_before_the_first_one() -> None:
    """`increase()` needs a 0 before the first engine failure to count it at all."""
    values = samples(EngineMetrics())
    assert 0 == values[("otel_engine_request_errors_total", (("error_type", "engine_dead"),))]


@pytest.mark.parametrize(
    ("family", "label", "members"),
    [
        ("otel_engine_request_success_total", "finish_reason", FinishReason),
        ("otel_engine_http_connections_closed_total", "reason", ConnectionCloseReason),
        ("otel_engine_structured_output_invalid_total", "reason", InvalidJsonReason),
        ("otel_engine_tool_calls_total", "outcome", ToolCallOutcome),
    ],
)
def test_every_member_of_a_closed_set_is_a_label_at_zero(
    family: str, label: str, members: type[enum.StrEnum]
) -> None:
    values = samples(EngineMetrics())

    labelled = {dict(labels)[label] for name, labels in values if name == family}
    assert {m.value for m in members} == labelled


def test_a_finish_reason_outside_the_set_is_refused() -> None:
    with pytest.raises(KeyError):
        EngineMetrics().on_request_finished(
            finish_reason="done", num_prompt_tokens=1, num_generation_tokens=1, e2e_s=0.1
        )


def test_model_name_is_a_label_of_every_sample() -> None:
    """Dashboards select a model by `model_name`; it is on every series, process ones too."""
    metrics = EngineMetrics(model_name="smol", process_metrics=True)
    finish_one(metrics)
    metrics.on_request_error("engine_dead")
    values = samples(metrics)

    assert values
    assert all(("model_name", "smol") in labels for _, labels in values)
    assert (
        1
        == values[
            (
                "otel_engine_request_errors_total",
                (("error_type", "engine_dead"), ("model_name", "smol")),
            )
        ]
    )
    start_times = [
        v for (name, _), v in values.items() if name.endswith("process_start_time_seconds")
    ]
    assert len(start_times) == 1
    assert start_times[0] > 1.7e9


def test_latency_exemplars_carry_the_trace_id_in_openmetrics_only() -> None:
    """TTFT and e2e buckets link to the request's trace in OpenMetrics; Prometheus text has no
    exemplars (its format cannot carry them)."""
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metrics = EngineMetrics(model_name="smol")
    metrics.on_request_finished(
        finish_reason="stop",
        num_prompt_tokens=3,
        num_generation_tokens=4,
        e2e_s=0.3,
        ttft_s=0.1,
        trace_id=trace_id,
    )
    body, content_type = metrics.render(openmetrics=True)
    text = body.decode()

    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    exemplar_lines = [line for line in text.splitlines() if f'trace_id="{trace_id}"' in line]
    assert {line.split("_bucket")[0] for line in exemplar_lines} == {
        "otel_engine_time_to_first_token_seconds",
        "otel_engine_e2e_request_latency_seconds",
    }
    assert trace_id not in metrics.render()[0].decode()


def test_cache_config_is_one_info_sample() -> None:
    """A prefix-aware router models the cache from its block size and size in blocks."""
    metrics = EngineMetrics()
    metrics.set_cache_config(block_size=16, num_blocks=4096, prefix_caching=True)
    labels = (("block_size", "16"), ("enable_prefix_caching", "true"), ("num_blocks", "4096"))
    values = samples(metrics)
    assert [k for k in values if k[0] == "otel_engine_cache_config_info"] == [
        ("otel_engine_cache_config_info", labels)
    ]
    assert values[("otel_engine_cache_config_info", labels)] == 1


def test_vllm_names_copy_the_router_signals_with_the_same_values() -> None:
    """`--vllm-metric-names`: the names vLLM's router, the inference gateway's endpoint picker
    and vLLM dashboards read, with vLLM's label names, beside the otel_engine ones."""
    metrics = EngineMetrics(model_name="smol", vllm_names=True)
    metrics.set_cache_config(block_size=16, num_blocks=512, prefix_caching=True)
    metrics.on_step(Step())
    finish_one(metrics)
    body, _ = metrics.render()
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    values = samples(metrics)
    smol = (("model_name", "smol"),)

    assert values[("vllm:num_requests_waiting", smol)] == 2
    assert values[("vllm:num_requests_running", smol)] == 3
    assert values[("vllm:kv_cache_usage_perc", smol)] == 0.25
    info = (
        ("block_size", "16"),
        ("enable_prefix_caching", "true"),
        ("model_name", "smol"),
        ("num_gpu_blocks", "512"),
    )
    assert values[("vllm:cache_config_info", info)] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "stop"), *smol))] == 1
    assert values[("vllm:time_to_first_token_seconds_count", smol)] == 1
    # every copy has its source's type and samples (but the label values vLLM does not have,
    # merged into the ones it has); the source families are all still there
    for source, (name, _) in VLLM_NAMES.items():
        expected = len(families[source].samples)
        if source == "otel_engine_request_success":  # tool_calls' samples merged into stop's
            expected -= len(families[source].samples) // len(FinishReason)
        assert families[name].type == families[source].type, name
        assert len(families[name].samples) == expected, name
    assert set(FAMILIES) <= set(families)


def test_vllm_names_carry_only_the_finish_reasons_vllm_emits() -> None:
    """`vllm:request_success` has the finished_reason values vLLM's engine has (a request
    that ended with tool calls is counted as stopped, as vLLM counts it); the otel_engine
    family keeps `tool_calls`."""
    metrics = EngineMetrics(vllm_names=True)
    for reason in ("stop", "tool_calls", "tool_calls", "length"):
        metrics.on_request_finished(
            finish_reason=FinishReason(reason),
            num_prompt_tokens=1,
            num_generation_tokens=1,
            e2e_s=0.1,
            queue_s=0.0,
            ttft_s=0.1,
        )
    values = samples(metrics)

    vllm = {
        dict(labels)["finished_reason"]: value
        for (name, labels), value in values.items()
        if name == "vllm:request_success_total"
    }
    assert {"stop": 3, "length": 1, "abort": 0} == vllm
    assert 2 == values[("otel_engine_request_success_total", (("finish_reason", "tool_calls"),))]


def test_vllm_names_are_not_exported_over_otlp() -> None:
    """OTLP carries each value once, under the otel_engine name."""
    metrics = EngineMetrics(vllm_names=True)
    metrics.on_step(Step())
    exported = {m.name for m in registry_to_metrics(metrics.otlp_registry, 0)}
    assert "otel_engine_requests_waiting" in exported
    assert not [name for name in exported if name.startswith("vllm:")]
    assert "vllm:num_requests_waiting" in metrics.render()[0].decode()


def test_the_docs_list_every_vllm_name_and_what_it_copies() -> None:
    """docs/observability.md's table of vLLM's names is VLLM_NAMES, row for row."""
    import re

    from tests.helpers.paths import REPO_ROOT

    text = (REPO_ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    rows = re.findall(
        r"^\| `(vllm:[a-z0-9_]+)` \| `(otel_engine_[a-z0-9_]+)` \|(.*)\|$", text, re.M
    )
    documented = {
        source: (name, dict(re.findall(r"`(\w+)` as `(\w+)`", renames)))
        for name, source, renames in rows
    }
    assert VLLM_NAMES == documented
