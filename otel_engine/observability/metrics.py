"""The engine's Prometheus metrics (`otel_engine_*`), in a private registry per server.

`EngineMetrics` is fed by the api_server: once per engine step (`on_step`, from the stats
the engine core ships with each step's outputs) and once per request (`on_request_finished`
or `on_request_error`). Label children are bound once up front; an observation costs about
a microsecond. Latency histograms use the bucket boundaries of the OpenTelemetry GenAI
`gen_ai.server.*` metrics. `render()` answers GET /metrics; `otlp_metrics.py` exports the
same registry over OTLP when an endpoint is set.

With `model_name`, every sample carries a `model_name` label (the served model name), so
dashboards can select a model across replicas; it is added at collection time by one
wrapping collector, not per observation. Latency histograms take the request's trace id as an
exemplar; exemplars are only visible in the OpenMetrics exposition (`render(openmetrics=True)`,
which Prometheus asks for in its Accept header), so a latency panel can link to the trace.

With `vllm_names`, `/metrics` also shows the families routers and dashboards built for vLLM
read (`VLLM_NAMES`: `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:cache_config_info`, ...), copied from the `otel_engine_*` families when scraped: no
second observation on the hot path, the same values under two names. OTLP export
(`otlp_registry`) carries the `otel_engine_*` names only.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from otel_engine.errors import ErrorCode, FailureCause
from otel_engine.observability.decode_bandwidth import DecodeBandwidth
from otel_engine.observability.label_sets import (
    ConnectionCloseReason,
    HealthState,
    InvalidJsonReason,
    ToolCallOutcome,
)
from otel_engine.outputs import FinishReason

if TYPE_CHECKING:
    from otel_engine.model.bandwidth import MemoryBandwidth

# gen_ai.server.time_to_first_token
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
# gen_ai.server.time_per_output_token
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# gen_ai.server.request.duration (also used for queue time, which has no convention)
REQUEST_DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
# gen_ai.client.token.usage
TOKEN_BUCKETS = (
    1,
    4,
    16,
    64,
    256,
    1024,
    4096,
    16384,
    65536,
    262144,
    1048576,
    4194304,
    16777216,
    67108864,
)
STEP_DURATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# a structured-output grammar built in the engine core (a cached one costs nothing)
GRAMMAR_COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# a step's structured-output masks, all its grammar rows together (steps without one: none)
GRAMMAR_MASK_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# failures with no exception of their own (FailureCause), counted from 0 from the start
RESTART_CAUSES = (
    FailureCause.ENGINE_CORE_DIED,
    FailureCause.WORKER_DIED,
    FailureCause.STEP_TIMEOUT,
    FailureCause.ENGINE_STALLED,
)
# crash to a carried-over request's first token after the restart (engine/recovery.py)
# a request's accepted share of the proposed tokens it verified (speculative decoding)
ACCEPTANCE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# error_type values that exist at 0 from the start, so that `increase()` sees the first one:
# engine failures and clients dropped for not reading (the others appear when they happen)
PRESET_ERROR_TYPES = (
    ErrorCode.ENGINE_DEAD,
    ErrorCode.CLIENT_STALLED,
    ErrorCode.ENGINE_FAULT_REQUEST,
)


# `--vllm-metric-names`: otel_engine family -> (vLLM's family name, label renames). These are
# the names vLLM's router, the Gateway API inference extension's endpoint picker (its model
# server protocol: queue, running, KV utilization, cache config) and vLLM dashboards read.
VLLM_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    "otel_engine_requests_waiting": ("vllm:num_requests_waiting", {}),
    "otel_engine_requests_running": ("vllm:num_requests_running", {}),
    "otel_engine_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", {}),
    "otel_engine_cache_config_info": ("vllm:cache_config_info", {"num_blocks": "num_gpu_blocks"}),
    "otel_engine_prefix_cache_queries": ("vllm:prefix_cache_queries", {}),
    "otel_engine_prefix_cache_hits": ("vllm:prefix_cache_hits", {}),
    "otel_engine_prompt_tokens": ("vllm:prompt_tokens", {}),
    "otel_engine_generation_tokens": ("vllm:generation_tokens", {}),
    "otel_engine_request_success": ("vllm:request_success", {"finish_reason": "finished_reason"}),
    "otel_engine_preemptions": ("vllm:num_preemptions", {}),
    "otel_engine_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", {}),
    "otel_engine_time_per_output_token_seconds": ("vllm:time_per_output_token_seconds", {}),
    "otel_engine_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds", {}),
    "otel_engine_request_queue_time_seconds": ("vllm:request_queue_time_seconds", {}),
    "otel_engine_request_prompt_tokens": ("vllm:request_prompt_tokens", {}),
    "otel_engine_request_generation_tokens": ("vllm:request_generation_tokens", {}),
    "otel_engine_spec_decode_proposed_tokens": ("vllm:spec_decode_num_draft_tokens", {}),
    "otel_engine_spec_decode_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", {}),
    "otel_engine_spec_decode_verifications": ("vllm:spec_decode_num_drafts", {}),
}
# Label values of the copies that vLLM does not emit, as vLLM counts them: its engine ends a
# request that called tools as any other that stopped (its finished_reason is stop, length,
# abort, error or repetition; tool_calls is only the OpenAI answer's).
VLLM_VALUES: dict[str, dict[str, dict[str, str]]] = {
    "otel_engine_request_success": {
        "finish_reason": {FinishReason.TOOL_CALLS: FinishReason.STOP},
    },
}


class StepStats(Protocol):
    """What `on_step` reads (`StepOutputs` has these). Optional extras, read when present:
    `step_id` (0: no step ran), `num_paused`, `kv_cache_cached_blocks`,
    `prefix_cache_queries`, `prefix_cache_hits`, `step_duration_s`, `num_scheduled_seqs`,
    `num_scheduled_tokens`, `grammar_compile_s`, `grammar_mask_s`, `num_grammar_deferred`,
    `decode_bandwidth`, `num_draft_tokens`, `num_accepted_tokens`, `num_verifications`."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int


class _ConstantLabels(Collector):
    """Collects an inner registry and adds the same labels to every sample."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self._inner = inner
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [
                sample._replace(labels={**sample.labels, **self._labels})
                for sample in family.samples
            ]
            yield family


class _Renamed(Collector):
    """Copies of the `names` families of `inner` under other names (VLLM_NAMES), their label
    values in `values` replaced (VLLM_VALUES) and the samples that then coincide merged: a
    count summed, a creation time the earliest."""

    def __init__(
        self,
        inner: Collector,
        names: dict[str, tuple[str, dict[str, str]]],
        values: dict[str, dict[str, dict[str, str]]],
    ) -> None:
        self._inner = inner
        self._names = names
        self._values = values

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            renamed = self._names.get(family.name)
            if renamed is None:
                continue
            name, label_names = renamed
            values = self._values.get(family.name, {})
            copy = Metric(name, family.documentation, family.type, family.unit)
            merged: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
            for source in family.samples:
                labels = {
                    label_names.get(k, k): values.get(k, {}).get(v, v)
                    for k, v in source.labels.items()
                }
                sample = source._replace(name=name + source.name[len(family.name) :], labels=labels)
                key = (sample.name, tuple(sorted(labels.items())))
                found = merged.get(key)
                if found is not None:
                    pick = min if sample.name.endswith("_created") else operator.add
                    sample = found._replace(value=pick(found.value, sample.value))
                merged[key] = sample
            copy.samples = list(merged.values())
            yield copy


class SpecMetrics:
    """Speculative decoding: proposed and accepted tokens, and each finished request's
    acceptance, labelled with the method (`bind`, once at start; nothing is counted before)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.proposed = Counter(
            "otel_engine_spec_decode_proposed_tokens",
            "Proposed tokens verified by speculative decoding, by method (ngram, draft).",
            ["method"],
            registry=r,
        )
        self.accepted = Counter(
            "otel_engine_spec_decode_accepted_tokens",
            "Proposed tokens speculative decoding accepted, by method.",
            ["method"],
            registry=r,
        )
        self.verifications = Counter(
            "otel_engine_spec_decode_verifications",
            "Verifications: a request's proposed tokens checked in one step (accepted / this: "
            "proposals kept per verification), by method.",
            ["method"],
            registry=r,
        )
        self.acceptance = Histogram(
            "otel_engine_spec_decode_acceptance_rate",
            "Per finished request that verified proposals: accepted / proposed tokens.",
            ["method"],
            buckets=ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.method: str | None = None
        self._bound: tuple[Counter, Counter, Counter, Histogram] | None = None

    def bind(self, method: str) -> None:
        """The engine's method: its series exist (at 0) from now."""
        self.method = method
        self._bound = (
            self.proposed.labels(method),
            self.accepted.labels(method),
            self.verifications.labels(method),
            self.acceptance.labels(method),
        )

    def on_step(self, num_drafts: int, num_accepted: int, num_verifications: int) -> None:
        if num_drafts and self._bound is not None:
            self._bound[0].inc(num_drafts)
            self._bound[1].inc(num_accepted)
            self._bound[2].inc(num_verifications)

    def on_request(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts and self._bound is not None:
            self._bound[3].observe(num_accepted / num_drafts)


def _grammar_metrics(r: CollectorRegistry) -> tuple[Histogram, Histogram, Counter]:
    """What structured-output grammars cost the engine core: builds, each step's masks, and
    the requests a step's mask budget made wait."""
    return (
        Histogram(
            "otel_engine_grammar_compile_seconds",
            "Time to build a structured-output grammar in the engine core (cache misses).",
            buckets=GRAMMAR_COMPILE_BUCKETS,
            registry=r,
        ),
        Histogram(
            "otel_engine_step_grammar_mask_seconds",
            "Time an engine step spent computing structured-output token masks (steps with "
            "a grammar row only).",
            buckets=GRAMMAR_MASK_BUCKETS,
            registry=r,
        ),
        Counter(
            "otel_engine_grammar_deferred",
            "Structured requests that sat an engine step out because the step's grammar masks "
            "had taken their budget (computed first at a later step).",
            registry=r,
        ),
    )


class EngineMetrics:
    """Every `otel_engine_*` family (docs/observability.md, "Metrics"), with per-step and
    per-request hooks."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str | None = None,
        process_metrics: bool = False,
        vllm_names: bool = False,
    ) -> None:
        """`registry` is what `render()` exposes (a new one by default); `model_name` adds that
        label to every sample; `process_metrics` adds `otel_engine_process_*` (CPU, RSS, open
        fds, start time) of this process, whose start time changes on every restart;
        `vllm_names` adds the VLLM_NAMES copies to `registry` (not to `otlp_registry`)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self._families_registry(model_name, vllm_names)
        if process_metrics:
            ProcessCollector(namespace="otel_engine", registry=r)
        self.requests_running = Gauge(
            "otel_engine_requests_running", "Requests in the engine's running batch.", registry=r
        )
        self.requests_waiting = Gauge(
            "otel_engine_requests_waiting", "Requests queued in the engine.", registry=r
        )
        self.requests_paused = Gauge(
            "otel_engine_requests_paused",
            "Streaming requests paused because their client stopped reading.",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "otel_engine_kv_cache_usage_ratio",
            "Fraction of KV cache blocks in use (0-1).",
            registry=r,
        )
        self.cache_config = Gauge(
            "otel_engine_cache_config_info",
            "1, labelled with the KV cache's block size in tokens, its size in blocks and whether "
            "prefix caching is on (what a prefix-aware router needs to model the cache).",
            ["block_size", "num_blocks", "enable_prefix_caching"],
            registry=r,
        )
        self.kv_cache_cached_blocks = Gauge(
            "otel_engine_kv_cache_cached_blocks",
            "Free KV blocks that still hold a cached prefix (reused on a hit, else evicted).",
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "otel_engine_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (once per request).",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "otel_engine_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (their KV was not computed again).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "otel_engine_prompt_tokens", "Prompt tokens of finished or failed requests.", registry=r
        )
        self.generation_tokens = Counter(
            "otel_engine_generation_tokens",
            "Generated tokens of finished or failed requests.",
            registry=r,
        )
        self.request_success = Counter(
            "otel_engine_request_success",
            "Requests that finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.request_errors = Counter(
            "otel_engine_request_errors",
            "Requests that failed, by error type.",
            ["error_type"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "otel_engine_time_to_first_token_seconds",
            "Arrival to first output token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "otel_engine_time_per_output_token_seconds",
            "Mean time per output token after the first.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "otel_engine_e2e_request_latency_seconds",
            "Arrival to last output token.",
            buckets=REQUEST_DURATION_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "otel_engine_request_queue_time_seconds",
            "Arrival to first scheduled.",
            buckets=REQUEST_DURATION_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "otel_engine_request_prompt_tokens",
            "Prompt tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "otel_engine_request_generation_tokens",
            "Generated tokens per request.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "otel_engine_step_duration_seconds",
            "Wall time of one engine step.",
            buckets=STEP_DURATION_BUCKETS,
            registry=r,
        )
        self.step_batch_size = Histogram(
            "otel_engine_step_batch_size",
            "Sequences scheduled per engine step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "otel_engine_step_tokens",
            "Tokens computed per engine step.",
            buckets=STEP_TOKENS_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "otel_engine_preemptions", "Requests preempted (KV blocks reclaimed).", registry=r
        )
        self.spec = SpecMetrics(r)
        self.ignored_request_fields = Counter(
            "otel_engine_ignored_request_fields",
            "Request body fields the API does not know, ignored (logged: request.ignored_fields).",
            registry=r,
        )
        self.grammar_compile, self.step_grammar_mask, self.grammar_deferred = _grammar_metrics(r)
        self.structured_output_invalid = Counter(
            "otel_engine_structured_output_invalid",
            "Structured-output choices returned without valid JSON, by reason: length "
            "(max_tokens cut it), stop_string (a stop string cut it), invalid (a bug).",
            ["reason"],
            registry=r,
        )
        self.tool_calls = Counter(
            "otel_engine_tool_calls",
            "Tool calls in answers to requests with tools, by outcome: parsed (returned as a "
            "tool call) or invalid (malformed, truncated or naming no tool of the request: "
            "returned as text).",
            ["outcome"],
            registry=r,
        )
        self.telemetry_export_failures = Counter(
            "otel_engine_telemetry_export_failures",
            "Exports of this server process's spans, metrics or logs that failed after the "
            "exporter's retries (the collector is unreachable or refused them), by signal.",
            ["signal"],
            registry=r,
        )
        self.frontend_requests = Gauge(
            "otel_engine_frontend_requests",
            "Requests with state in the api_server; above 0 with no traffic is a leak.",
            registry=r,
        )
        self.connections_open = Gauge(
            "otel_engine_http_connections", "Open HTTP connections.", registry=r
        )
        self.connections_closed = Counter(
            "otel_engine_http_connections_closed",
            "HTTP connections the server closed to stay within its limits, by reason.",
            ["reason"],
            registry=r,
        )
        self.fast_path = Gauge(
            "otel_engine_fast_path_info",
            "1 per fast path the model could run (model/fast_paths.py) and rank, labelled with "
            "whether that rank runs it and its CPU's and kernel build's instruction sets.",
            ["path", "rank", "enabled", "cpu_isa", "kernel_isa"],
            registry=r,
        )
        self.memory_read_bandwidth = Gauge(
            "otel_engine_memory_read_bandwidth_bytes_per_second",
            "The memory read bandwidth rank 0 measured at start with its threads (0: none).",
            registry=r,
        )
        self.decode_bandwidth = Gauge(
            "otel_engine_decode_bandwidth_bytes_per_second",
            "Weights and KV cache bytes rank 0 read in the steps of decodes alone of about the "
            "last second of their time, over that time.",
            registry=r,
        )
        self.decode_bandwidth_ratio = Gauge(
            "otel_engine_decode_bandwidth_ratio",
            "The recent decode-only steps' bandwidth over the measured memory read bandwidth.",
            registry=r,
        )
        self.bandwidth = DecodeBandwidth(None)  # what GET /v1/models shows of the same
        self._add_health_families(r)
        self._success = {reason: self.request_success.labels(reason) for reason in FinishReason}
        self._errors: dict[str, Any] = {
            error_type: self.request_errors.labels(error_type) for error_type in PRESET_ERROR_TYPES
        }
        self._health = {state: self.health_state.labels(state) for state in HealthState}
        self._closed = {r: self.connections_closed.labels(r) for r in ConnectionCloseReason}
        self._export_failures = {
            s: self.telemetry_export_failures.labels(s) for s in ("traces", "metrics", "logs")
        }
        self._invalid_json = {
            r: self.structured_output_invalid.labels(r) for r in InvalidJsonReason
        }
        self._tool_calls = {o: self.tool_calls.labels(o) for o in ToolCallOutcome}
        self.set_health(HealthState.STARTING)

    def _add_health_families(self, r: CollectorRegistry) -> None:
        """The engine's health state, and its restarts in place (--on-engine-failure
        restart, engine/recovery.py)."""
        self.health_state = Gauge(
            "otel_engine_engine_health_state",
            "1 for the engine's current state, else 0.",
            ["state"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "otel_engine_engine_restarts",
            "Engine restarts begun after a failure (--on-engine-failure restart; one that does "
            "not start counts too), by the "
            "failure's type (an exception class, or EngineCoreDied, WorkerDied, StepTimeout, ...).",
            ["cause"],
            registry=r,
        )
        for cause in RESTART_CAUSES:  # at 0 from the start, so that increase() sees the first
            self.engine_restarts.labels(cause)
        self.requests_migrated = Counter(
            "otel_engine_requests_migrated",
            "In-flight requests carried over to a restarted engine (one per request and restart).",
            registry=r,
        )
        self.tokens_recomputed = Counter(
            "otel_engine_tokens_recomputed",
            "Prompt and already-sent tokens the carried-over requests had computed again.",
            registry=r,
        )
        self.recovery_time = Histogram(
            "otel_engine_engine_recovery_seconds",
            "From an engine failure to a carried-over request's first token after the restart.",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.requests_poisoned = Counter(
            "otel_engine_requests_poisoned",
            "Requests failed alone (engine_fault_request) for being in the failing batch of "
            "two engine failures in a row.",
            registry=r,
        )

    def _families_registry(self, model_name: str | None, vllm_names: bool) -> CollectorRegistry:
        """Where the families are registered: `registry` itself, or an inner one that
        `registry` collects with the model_name label (and copies under VLLM_NAMES)."""
        self.otlp_registry = self.registry
        if model_name is None and not vllm_names:
            return self.registry
        inner = CollectorRegistry()
        labelled = _ConstantLabels(inner, {} if model_name is None else {"model_name": model_name})
        self.registry.register(labelled)
        if vllm_names:
            self.otlp_registry = CollectorRegistry()
            self.otlp_registry.register(labelled)
            self.registry.register(_Renamed(labelled, VLLM_NAMES, VLLM_VALUES))
        return inner

    def on_tool_calls(self, outcome: ToolCallOutcome, count: int) -> None:
        """Tool calls of one choice, by outcome."""
        if count:
            self._tool_calls[outcome].inc(count)

    def on_ignored_fields(self, num_fields: int) -> None:
        self.ignored_request_fields.inc(num_fields)

    def on_export_failure(self, signal: str) -> None:
        """An OTLP export of this process failed (observability/otlp_export.py)."""
        self._export_failures[signal].inc()

    def on_structured_output_invalid(self, reason: InvalidJsonReason) -> None:
        """A structured-output choice returned without valid JSON."""
        self._invalid_json[reason].inc()

    def on_step(self, stats: StepStats) -> None:
        """Scheduler state after one engine step, and that step's cost (step_id 0: the
        state changed between steps; there is no cost to record)."""
        for seconds in getattr(stats, "grammar_compile_s", ()):
            self.grammar_compile.observe(seconds)
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.requests_paused.set(getattr(stats, "num_paused", 0))
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_cache_cached_blocks.set(getattr(stats, "kv_cache_cached_blocks", 0))
        queried = getattr(stats, "prefix_cache_queries", 0)
        if queried:
            self.prefix_cache_queries.inc(queried)
            self.prefix_cache_hits.inc(getattr(stats, "prefix_cache_hits", 0))
        if not getattr(stats, "step_id", 1):
            return
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        duration = getattr(stats, "step_duration_s", None)
        if duration is not None:
            self.step_duration.observe(duration)
        num_seqs = getattr(stats, "num_scheduled_seqs", None)
        if num_seqs:
            self.step_batch_size.observe(num_seqs)
        num_tokens = getattr(stats, "num_scheduled_tokens", None)
        if num_tokens:
            self.step_tokens.observe(num_tokens)
        mask_s = getattr(stats, "grammar_mask_s", 0.0)
        if mask_s:
            self.step_grammar_mask.observe(mask_s)
        num_deferred = getattr(stats, "num_grammar_deferred", 0)
        if num_deferred:
            self.grammar_deferred.inc(num_deferred)
        self.spec.on_step(
            getattr(stats, "num_draft_tokens", 0),
            getattr(stats, "num_accepted_tokens", 0),
            getattr(stats, "num_verifications", 0),
        )
        bandwidth = getattr(stats, "decode_bandwidth", 0.0)
        if bandwidth and duration:
            self.bandwidth.observe(bandwidth, duration)
            recent = self.bandwidth.recent or 0.0
            self.decode_bandwidth.set(recent)
            self.decode_bandwidth_ratio.set(self.bandwidth.ratio(recent) or 0.0)

    def on_request_finished(
        self,
        *,
        finish_reason: FinishReason,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        e2e_s: float,
        queue_s: float | None = None,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        trace_id: str | None = None,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
    ) -> None:
        """A request that ended normally; TPOT defaults to (e2e - ttft) / (n - 1). `trace_id`
        (32 hex digits) becomes the exemplar of the TTFT and end-to-end latency observations.
        With proposed tokens verified, its acceptance rate is observed too."""
        self._success[finish_reason].inc()
        self.spec.on_request(num_draft_tokens, num_accepted_tokens)
        self._count_tokens(num_prompt_tokens, num_generation_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        exemplar = None if trace_id is None else {"trace_id": trace_id}
        self.e2e_latency.observe(e2e_s, exemplar)
        if queue_s is not None:
            self.queue_time.observe(queue_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s, exemplar)
            if tpot_s is None and num_generation_tokens > 1:
                tpot_s = (e2e_s - ttft_s) / (num_generation_tokens - 1)
        if tpot_s is not None:
            self.time_per_output_token.observe(tpot_s)

    def on_request_error(
        self, error_type: str, *, num_prompt_tokens: int = 0, num_generation_tokens: int = 0
    ) -> None:
        """A failed request (4xx kind, abort, engine error); keep `error_type` low-cardinality."""
        child = self._errors.get(error_type)
        if child is None:
            child = self._errors[error_type] = self.request_errors.labels(error_type)
        child.inc()
        self._count_tokens(num_prompt_tokens, num_generation_tokens)

    def on_connection_closed(self, reason: ConnectionCloseReason) -> None:
        """The server closed a connection to keep within its limits (connections.py)."""
        self._closed[reason].inc()

    def set_fast_paths(self, plans: dict[str, Any] | None) -> None:
        """Every rank's fast-path decisions (`executor/rank_plans.py`), once at start."""
        for rank, summary in enumerate((plans or {}).get("ranks") or []):
            cpu, build = str(summary.get("cpu_isa")), str(summary.get("kernel_isa") or "none")
            for path, choice in summary.get("paths", {}).items():
                enabled = "true" if choice.get("enabled") else "false"
                self.fast_path.labels(path, str(rank), enabled, cpu, build).set(1)

    def set_memory_bandwidth(self, peak: MemoryBandwidth | None) -> None:
        """Rank 0's measured memory read bandwidth (`model/bandwidth.py`), once at start."""
        self.bandwidth.peak = peak
        self.memory_read_bandwidth.set(0.0 if peak is None else peak.bytes_per_second)

    def set_cache_config(self, *, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """The KV cache's shape, once at start (`otel_engine_cache_config_info`)."""
        self.cache_config.clear()
        prefix = "true" if prefix_caching else "false"
        self.cache_config.labels(str(block_size), str(num_blocks), prefix).set(1)

    def on_engine_restart(self, cause: str) -> None:
        self.engine_restarts.labels(cause).inc()

    def on_requests_migrated(self, num_requests: int, num_tokens: int) -> None:
        self.requests_migrated.inc(num_requests)
        self.tokens_recomputed.inc(num_tokens)

    def on_stream_recovered(self, seconds: float) -> None:
        self.recovery_time.observe(seconds)

    def on_request_poisoned(self) -> None:
        self.requests_poisoned.inc()

    def set_health(self, state: HealthState) -> None:
        """The engine's state is `state` (and no other)."""
        if state not in self._health:
            raise ValueError(f"health state must be one of {tuple(HealthState)}, got {state!r}")
        for name, child in self._health.items():
            child.set(1 if name == state else 0)

    def render(self, *, openmetrics: bool = False) -> tuple[bytes, str]:
        """The registry in Prometheus text format (or OpenMetrics, which carries exemplars),
        and its content type."""
        if openmetrics:
            return generate_openmetrics(self.registry), OPENMETRICS_TYPE
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _count_tokens(self, num_prompt: int, num_generated: int) -> None:
        if num_prompt:
            self.prompt_tokens.inc(num_prompt)
        if num_generated:
            self.generation_tokens.inc(num_generated)
