"""The "otel-engine / Serving overview" dashboard: traffic, errors, latency, tokens, capacity."""

from __future__ import annotations

from typing import Any

from board_kit import (
    ABORTS,
    HEALTH_DESCRIPTION,
    OPS,
    RATE,
    SEL,
    SERVER_ERRORS,
    dashboard,
    graph,
    health_timeline,
    percentiles,
    quantile,
    rate_sum,
    row,
    target,
)


def overview() -> dict[str, Any]:
    """Serving overview: traffic, errors, latency, tokens and capacity."""
    traffic = row(
        "Health and traffic",
        [
            health_timeline(HEALTH_DESCRIPTION),
            graph(
                "Requests per second",
                "Finished requests per second by finish_reason (stop, length, abort) and "
                "failed requests per second. A drop to zero with traffic still arriving "
                "means the engine is stuck or dead: check Engine health state and the "
                "Engine & failures dashboard. Many 'length' finishes: clients hit max_tokens "
                "or --max-model-len.",
                "reqps",
                [
                    target(
                        rate_sum("otel_engine_request_success_total", by="finish_reason"),
                        "finished: {{finish_reason}}",
                    ),
                    target(rate_sum("otel_engine_request_errors_total"), "failed"),
                ],
            ),
            graph(
                "Error ratio",
                "Failed requests / all requests that ended (finished + failed) over the rate "
                "window. Above a few percent: look at Failed requests by error type; engine "
                "errors (engine_dead) are server faults, see "
                f"{OPS}; client errors point at the callers.",
                "percentunit",
                [
                    target(
                        f"{rate_sum('otel_engine_request_errors_total')} / "
                        f"({rate_sum('otel_engine_request_errors_total')} + "
                        f"{rate_sum('otel_engine_request_success_total')})",
                        "error ratio",
                    )
                ],
                max_val=1,
            ),
            graph(
                "Failed requests by error type",
                "Failed requests per second by error_type. engine_dead: the engine crashed "
                "and took its in-flight requests with it (a stall that was given up ends the "
                "same way); open the crash dump (Engine & failures dashboard) and follow its "
                "trace_id. shutting_down: requests refused while draining. "
                "invalid_value, invalid_json, context_length_exceeded, model_not_found, "
                "invalid_api_key: fix the client or its model name / key.",
                "reqps",
                [
                    target(
                        rate_sum("otel_engine_request_errors_total", by="error_type"),
                        "{{error_type}}",
                    )
                ],
            ),
            graph(
                "Responses by status class",
                "Requests per second by HTTP status class, derived from error_type: 2xx = "
                "finished, 5xx = engine failures, drain refusals and internal errors, aborted "
                "= the client went away, 4xx = every other error type (client errors). "
                "Rising 5xx: see Engine & failures and docs/operations.md; rising 4xx: "
                "check the callers' requests; rising aborted: client timeouts shorter than "
                "the TTFT or end-to-end latency.",
                "reqps",
                [
                    target(rate_sum("otel_engine_request_success_total"), "2xx"),
                    target(
                        f"{rate_sum('otel_engine_request_errors_total')} - "
                        + rate_sum(
                            "otel_engine_request_errors_total",
                            f'error_type=~"{SERVER_ERRORS}|{ABORTS}"',
                        ),
                        "4xx",
                    ),
                    target(
                        rate_sum(
                            "otel_engine_request_errors_total", f'error_type=~"{SERVER_ERRORS}"'
                        ),
                        "5xx",
                    ),
                    target(
                        f"{rate_sum('otel_engine_request_errors_total')} - "
                        + rate_sum("otel_engine_request_errors_total", f'error_type!~"{ABORTS}"'),
                        "aborted",
                    ),
                ],
                stacked=True,
            ),
        ],
    )
    exemplar_hint = (
        " Exemplar dots carry the request's trace_id: click one to open the trace in Tempo."
    )
    latency = row(
        "Latency",
        [
            graph(
                "Time to first token",
                "p50/p95/p99 of arrival to first output token (TTFT). High with many "
                "Waiting requests: the engine is saturated, lower --max-num-seqs pressure by "
                "adding replicas; high with few waiting: long prompts, raise "
                "--max-num-batched-tokens so prefills take fewer steps." + exemplar_hint,
                "s",
                percentiles("otel_engine_time_to_first_token_seconds", exemplar=True),
                width=8,
            ),
            graph(
                "Time per output token",
                "p50/p95/p99 of the mean time between output tokens after the first (TPOT). "
                "Rising with batch size is expected; rising with Preemptions means the KV "
                "cache is too small (raise --num-kv-blocks or --kv-cache-memory-gib, or "
                "lower --max-num-seqs); see Step duration on Engine & failures.",
                "s",
                percentiles("otel_engine_time_per_output_token_seconds", exemplar=True),
                width=8,
            ),
            graph(
                "End-to-end request latency",
                "p50/p95/p99 of arrival to last output token. Compare with TTFT and TPOT to "
                "tell queueing from decoding; a cliff at the top bucket or missing points "
                "with engine_dead errors means requests died with the engine." + exemplar_hint,
                "s",
                percentiles("otel_engine_e2e_request_latency_seconds", exemplar=True),
                width=8,
            ),
        ],
    )
    capacity = row(
        "Tokens and capacity",
        [
            graph(
                "Tokens per second",
                "Input (prompt) and output (generated) tokens per second. Output falling "
                "while requests keep arriving: the engine is stalled or preempting; check "
                "Preemptions and Engine health state.",
                "short",
                [
                    target(rate_sum("otel_engine_prompt_tokens_total"), "input tokens/s"),
                    target(rate_sum("otel_engine_generation_tokens_total"), "output tokens/s"),
                ],
            ),
            graph(
                "Tokens per request",
                "p50/p95 of prompt and generated tokens per finished request. Prompts near "
                "--max-model-len cause context_length_exceeded errors and long prefills; "
                "generated tokens pinned at max_tokens: clients set it too low.",
                "short",
                [
                    target(quantile(0.5, "otel_engine_request_prompt_tokens"), "prompt p50"),
                    target(quantile(0.95, "otel_engine_request_prompt_tokens"), "prompt p95"),
                    target(quantile(0.5, "otel_engine_request_generation_tokens"), "generated p50"),
                    target(
                        quantile(0.95, "otel_engine_request_generation_tokens"), "generated p95"
                    ),
                ],
            ),
            graph(
                "Running and waiting requests",
                "Requests in the running batch and queued, per instance. Waiting that keeps "
                "growing: demand exceeds capacity; add replicas, or raise --max-num-seqs if "
                "KV cache usage has headroom. Running stuck at a constant with no tokens "
                "flowing: a stalled step (health state stalled after --step-timeout).",
                "short",
                [
                    target(
                        f"sum by (instance) (otel_engine_requests_running{{{SEL}}})",
                        "running {{instance}}",
                    ),
                    target(
                        f"sum by (instance) (otel_engine_requests_waiting{{{SEL}}})",
                        "waiting {{instance}}",
                    ),
                ],
                width=8,
            ),
            graph(
                "KV cache usage",
                "Fraction of KV cache blocks in use, per instance. Near 1 with Preemptions "
                "rising: the cache is too small for the batch; raise --num-kv-blocks or "
                "--kv-cache-memory-gib, or lower --max-num-seqs.",
                "percentunit",
                [
                    target(
                        f"max by (instance) (otel_engine_kv_cache_usage_ratio{{{SEL}}})",
                        "{{instance}}",
                    )
                ],
                width=8,
                max_val=1,
            ),
            graph(
                "Preemptions per second",
                "Requests preempted (their KV blocks reclaimed and recomputed later). Above "
                "zero for long: the KV cache is full (see KV cache usage); raise "
                "--num-kv-blocks or --kv-cache-memory-gib, or lower --max-num-seqs.",
                "short",
                [
                    target(
                        f"sum by (instance) (rate(otel_engine_preemptions_total{{{SEL}}}{RATE}))",
                        "{{instance}}",
                    )
                ],
                width=8,
            ),
            graph(
                "Prefix cache hit rate",
                "Share of prompt tokens whose KV came from the prefix cache instead of being "
                "computed, per instance. High for chat (each turn resends the history) and "
                "for shared system prompts; near 0 with such traffic: the cache is evicted "
                "before reuse (see Cached KV blocks; raise --num-kv-blocks or "
                "--kv-cache-memory-gib), or the prompts differ in their first block.",
                "percentunit",
                [
                    target(
                        f"sum by (instance) (rate(otel_engine_prefix_cache_hits_total{{{SEL}}}"
                        f"{RATE})) / sum by (instance) (rate("
                        f"otel_engine_prefix_cache_queries_total{{{SEL}}}{RATE}))",
                        "{{instance}}",
                    )
                ],
                max_val=1,
            ),
            graph(
                "Cached KV blocks",
                "Free KV blocks that still hold a cached prefix, per instance: reused when a "
                "request shares it, evicted (least recently freed first) when a request needs "
                "a block. At 0 under load: every block is in use and nothing stays cached; raise "
                "--num-kv-blocks or --kv-cache-memory-gib if the hit rate matters.",
                "short",
                [
                    target(
                        f"max by (instance) (otel_engine_kv_cache_cached_blocks{{{SEL}}})",
                        "{{instance}}",
                    )
                ],
            ),
        ],
    )
    structured = row(
        "Structured output",
        [
            graph(
                "Grammar compile time",
                "Percentiles of the time to build a response_format grammar in the engine core (a "
                "schema seen recently is cached and costs nothing). The request waits for it "
                "before its first step. Seconds here: very large schemas, or the first "
                "structured request of a process (its tokenizer view is built once); see "
                "docs/operations.md (Structured output).",
                "s",
                percentiles("otel_engine_grammar_compile_seconds", exemplar=True),
            ),
            graph(
                "Structured output without valid JSON",
                "Structured-output choices returned without valid JSON, per second, by reason. "
                "length: max_tokens cut the JSON (clients should raise it); stop_string: a "
                "stop string cut it (drop stop strings with response_format); invalid: it "
                "ended otherwise, which is a bug to report.",
                "short",
                [
                    target(
                        f"sum by (reason) (rate(otel_engine_structured_output_invalid_total"
                        f"{{{SEL}}}{RATE}))",
                        "{{reason}}",
                    )
                ],
            ),
        ],
    )
    fleet = row(
        "Fleet: each replica",
        [
            graph(
                "Requests per second by replica",
                "Finished and failed requests per second of each instance. Behind a router "
                "the replicas should carry similar shares; one far above the others: the "
                "router's policy or its health checks favour it; one at zero with traffic: "
                "the router took it out (unhealthy), or it is dead (see the Engine & failures "
                "dashboard, 'Which replicas failed').",
                "reqps",
                [
                    target(
                        rate_sum("otel_engine_request_success_total", by="instance"),
                        "finished {{instance}}",
                    ),
                    target(
                        rate_sum("otel_engine_request_errors_total", by="instance"),
                        "failed {{instance}}",
                    ),
                ],
                width=8,
            ),
            graph(
                "Time to first token p95 by replica",
                "The 95th percentile of time to first token of each instance. One replica "
                "slower than the others at the same load: a slower machine, a noisy "
                "neighbour, or more queueing there; check Running and waiting requests, and "
                "open an exemplar's trace.",
                "s",
                [
                    target(
                        "histogram_quantile(0.95, sum by (instance, le) (rate("
                        f"otel_engine_time_to_first_token_seconds_bucket{{{SEL}}}{RATE})))",
                        "{{instance}}",
                        exemplar=True,
                    )
                ],
                width=8,
            ),
            graph(
                "Output tokens per second by replica",
                "Generated tokens per second of each instance: what each replica adds to the "
                "fleet's throughput. All replicas near their single-server numbers "
                "(bench/throughput.py) and waiting requests growing: add replicas.",
                "short",
                [
                    target(
                        rate_sum("otel_engine_generation_tokens_total", by="instance"),
                        "{{instance}}",
                    )
                ],
                width=8,
            ),
        ],
    )
    return dashboard(
        "otel-engine-overview",
        "otel-engine / Serving overview",
        "Traffic, errors, latency (with exemplars linking to traces), tokens and capacity of "
        "otel-engine. Engine internals and crashes: otel-engine / Engine & failures.",
        [traffic, latency, capacity, structured, fleet],
    )
