"""The "otel-engine / Engine & failures" dashboard: crashes, stalls, restarts, scrape health,
the crash dumps from Loki, and the engine step internals."""

from __future__ import annotations

from typing import Any

from board_kit import (
    CRASH_LOG_QUERY,
    HEALTH_DESCRIPTION,
    LOKI,
    SEL,
    SERVER_ERRORS,
    dashboard,
    graph,
    health_timeline,
    mean_ratio,
    percentiles,
    quantile,
    rate_sum,
    row,
    single_stat,
    target,
)
from grafana_foundation_sdk.builders import logs, loki
from grafana_foundation_sdk.models import common as mcommon


def failures() -> dict[str, Any]:
    """Engine & failures: engine errors, crashes, scrape health, crash dumps, step internals."""
    engine_dead_in_range = (
        "sum(increase(otel_engine_request_errors_total"
        f'{{{SEL}, error_type="engine_dead"}}[$__range]))'
    )
    failed = row(
        "Engine failures",
        [
            health_timeline(HEALTH_DESCRIPTION),
            single_stat(
                "Requests failed by engine crashes",
                "Requests failed with engine_dead over the dashboard time range: the "
                "in-flight requests an engine death killed (a scrape gap alone would hide "
                "them). Above zero: open Crash dumps below, follow the trace_id to the "
                "failing engine_core.step span, and read docs/operations.md, "
                "'Reading a crash'.",
                "short",
                [target(engine_dead_in_range, "engine_dead")],
                red_from=1,
            ),
            single_stat(
                "Server-side errors in range by type",
                "Requests failed by server-side errors over the time range, by error_type. "
                "engine_dead: an engine crash or a stall that was given up (see Crash dumps; "
                "the dump's failure says which process and how); shutting_down: refused while "
                "draining; internal_server_error: an api_server bug, find the "
                "request.internal_error log line (docs/operations.md).",
                "short",
                [
                    target(
                        "sum by (error_type) (increase(otel_engine_request_errors_total"
                        f'{{{SEL}, error_type=~"{SERVER_ERRORS}"}}[$__range]))',
                        "{{error_type}}",
                    )
                ],
                red_from=1,
            ),
            single_stat(
                "Instances that went dead",
                "Instances whose health state was dead at some scrape in the time range. "
                "Above zero: the engine crashed there; its crash dump and the Engine crash "
                "annotation mark when. If no scrape caught the dead state, set "
                "--final-scrape-wait above the scrape interval.",
                "short",
                [
                    target(
                        "sum(max_over_time(otel_engine_engine_health_state"
                        f'{{{SEL}, state="dead"}}[$__range]))',
                        "dead",
                    )
                ],
                red_from=1,
            ),
            single_stat(
                "Which replicas failed",
                "One value per instance: 1 if its engine was dead at some scrape in the time "
                "range, else 0. In a fleet this names the replica whose crash dump to read "
                "(Crash dumps below, filtered by instance); the router should have stopped "
                "sending it requests (docs/operations.md, 'Running a fleet').",
                "short",
                [
                    target(
                        "max by (instance) (max_over_time(otel_engine_engine_health_state"
                        f'{{{SEL}, state="dead"}}[$__range]))',
                        "{{instance}}",
                    )
                ],
                red_from=1,
            ),
            single_stat(
                "Process restarts",
                "Changes of otel_engine_process_start_time_seconds over the time range: "
                "how often an api_server process was restarted (by the orchestrator after "
                "an exit). Above zero: find the cause in Crash dumps or in the exit code "
                "(docs/operations.md, 'Exit codes').",
                "short",
                [
                    target(
                        f"sum(changes(otel_engine_process_start_time_seconds{{{SEL}}}[$__range]))",
                        "restarts",
                    )
                ],
                red_from=1,
            ),
            graph(
                "Server-side errors per second by type",
                "Requests failed per second by server-side error_type. A spike of "
                "engine_dead is one crash failing its in-flight batch: open Crash dumps and "
                "follow the trace_id. Steady shutting_down: clients keep sending to an "
                "instance that drains; check the load balancer's readiness checks.",
                "reqps",
                [
                    target(
                        rate_sum(
                            "otel_engine_request_errors_total",
                            f'error_type=~"{SERVER_ERRORS}"',
                            by="error_type",
                        ),
                        "{{error_type}}",
                    )
                ],
            ),
            graph(
                "Scrape health (up)",
                "1 when Prometheus scraped the instance (job otel-engine), 0 when it failed. "
                "0 after a crash is expected until the process restarts; 0 for long: the "
                "process is not running or still loading the model (the port does not "
                "listen while loading, see --engine-ready-timeout).",
                "short",
                [target('up{job="otel-engine", instance=~"$instance"}', "{{instance}}")],
                max_val=1,
            ),
            graph(
                "API server uptime",
                "Seconds since each api_server process started; a drop to zero is a restart. "
                "Frequent drops: a crash loop, read the latest crash dump before restarting "
                "again.",
                "s",
                [
                    target(
                        f"time() - otel_engine_process_start_time_seconds{{{SEL}}}",
                        "{{instance}}",
                    )
                ],
            ),
            graph(
                "API server memory",
                "Resident memory of the api_server process. Growing without bound under "
                "steady load: a leak; collect a heap profile and report it.",
                "bytes",
                [target(f"otel_engine_process_resident_memory_bytes{{{SEL}}}", "{{instance}}")],
            ),
            logs.Panel()
            .title("Crash dumps")
            .description(
                "engine_crash_dump log lines from Loki: the failing step's batch, the "
                "exception and the process that failed. Each line carries the trace_id of "
                "the failing engine_core.step span; the trace_id field links to that trace "
                "in Tempo (its otel_engine.crash event). Empty with engine_dead errors "
                "above: the engine was started without --otlp-logs or the collector drops "
                "logs. See docs/operations.md, 'Reading a crash'."
            )
            .datasource(LOKI)
            .height(10)
            .span(24)
            .show_time(True)
            .wrap_log_message(True)
            .enable_log_details(True)
            .sort_order(mcommon.LogsSortOrder.DESCENDING)
            .targets([loki.Dataquery().datasource(LOKI).expr(CRASH_LOG_QUERY)]),
        ],
    )
    engine = row(
        "Engine core",
        [
            graph(
                "Step duration",
                "p50/p95/p99 wall time of one engine step (schedule, execute, update). "
                "Rising with Tokens per step is expected; rising alone: a slow device or "
                "worker. Approaching --step-timeout: the engine will be declared stalled.",
                "s",
                percentiles("otel_engine_step_duration_seconds", exemplar=True),
            ),
            graph(
                "Queue time",
                "p50/p95/p99 of arrival to first scheduled. High: requests wait for a batch "
                "slot or KV blocks; add replicas, or raise --max-num-seqs if KV cache usage "
                "has headroom.",
                "s",
                percentiles("otel_engine_request_queue_time_seconds", exemplar=True),
            ),
            graph(
                "Batch size",
                "Sequences scheduled per step: mean (rate of sum / rate of count) and p95. "
                "Pinned at --max-num-seqs with waiting requests: the batch limit is the "
                "bottleneck; low with waiting requests: the KV cache is (raise "
                "--num-kv-blocks or --kv-cache-memory-gib).",
                "short",
                [
                    target(mean_ratio("otel_engine_step_batch_size"), "mean"),
                    target(quantile(0.95, "otel_engine_step_batch_size"), "p95"),
                ],
            ),
            graph(
                "Tokens per step",
                "Tokens computed per step (prefill chunks plus one per decoding sequence): "
                "mean and p95. Pinned at --max-num-batched-tokens while TTFT is high: raise "
                "it if Step duration allows.",
                "short",
                [
                    target(mean_ratio("otel_engine_step_tokens"), "mean"),
                    target(quantile(0.95, "otel_engine_step_tokens"), "p95"),
                ],
            ),
        ],
    )
    return dashboard(
        "otel-engine-failures",
        "otel-engine / Engine & failures",
        "Engine failures (requests killed by crashes, stalls, restarts, scrape health), crash "
        "dumps from Loki linked to their traces, the limits per client, and the engine step "
        "internals.",
        [failed, clients(), engine],
    )


def clients() -> Any:
    """The limits per client at work: connections, paused and stalled streams."""
    return row(
        "Clients and limits",
        [
            graph(
                "HTTP connections",
                "Open connections, and connections the server closed per second to stay within "
                "its limits, by reason: refused (503 at --max-connections, every connection "
                "busy), evicted (an idle one closed for a new client), request_timeout (no "
                "whole request within --request-read-timeout), write_stalled (a client that "
                "stopped reading, after --stream-write-timeout). Sustained refused: raise "
                "--max-connections or add replicas; bursts of request_timeout or evicted: idle "
                "or slow clients, often a connection flood (docs/operations.md, 'Hostile "
                "clients').",
                "short",
                [
                    target(f"sum(otel_engine_http_connections{{{SEL}}})", "open"),
                    target(
                        rate_sum("otel_engine_http_connections_closed_total", by="reason"),
                        "closed: {{reason}}",
                    ),
                ],
            ),
            graph(
                "Paused and stalled streams",
                "Streams paused because their client stopped reading (they hold no batch slot "
                "and no KV block until the client reads again), and streams aborted per second "
                "as client_stalled. Many paused or stalled: check the clients' network and "
                "whether they read their streams (--stream-write-timeout drops them). Request "
                "state held by the api_server (frontend) follows the traffic back to 0; stuck "
                "above 0 with no traffic is a leak: collect a heap profile and report it.",
                "short",
                [
                    target(f"sum(otel_engine_requests_paused{{{SEL}}})", "paused"),
                    target(
                        rate_sum("otel_engine_request_errors_total", 'error_type="client_stalled"'),
                        "client_stalled/s",
                    ),
                    target(f"sum(otel_engine_frontend_requests{{{SEL}}})", "frontend requests"),
                ],
            ),
        ],
    )
