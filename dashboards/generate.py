"""Generate the otel-engine Grafana dashboards (`dashboards/*.json`) from Python.

Run `python dashboards/generate.py` to rewrite the JSON next to this file, or with `--check`
to fail (exit 1, naming the file) when a committed file differs from what this script builds;
CI runs the check through `tests/dashboards/`. The dashboards are built with
grafana-foundation-sdk (schemaVersion 42) so panels stay typed, and every PromQL expression
is kept honest by tests: each one parses (`promtool check rules`) and each one returns data
from a real server scraped by a real Prometheus, except `AFTER_CRASH_ONLY`, which are checked
after an injected crash.

Two dashboards: the serving overview (traffic, errors, latency, tokens, batch, KV cache,
health) and the engine & failures dashboard (engine step internals, engine failures, crashes,
scrape health and the crash-dump log lines that link to their traces).

The module is also imported by the tests (by path: `dashboards/` is not a package), which use
`build_dashboards`, `prometheus_queries`, `substitute` and `AFTER_CRASH_ONLY`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

with warnings.catch_warnings():
    # The v1 dashboard builder warns "prefer dashboardv2" at import; Grafana's file provisioning
    # and schemaVersion 42 are the v1 model, which is what we want.
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import common as gcommon
    from grafana_foundation_sdk.builders import dashboard as gdash
    from grafana_foundation_sdk.builders import (
        logs,
        loki,
        prometheus,
        stat,
        statetimeline,
        timeseries,
    )
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common as mcommon
    from grafana_foundation_sdk.models import dashboard as mdash
    from grafana_foundation_sdk.models.common import DataSourceRef

HERE = Path(__file__).resolve().parent
OVERVIEW = "otel-engine-overview.json"
FAILURES = "otel-engine-failures.json"

PROM = DataSourceRef(type_val="prometheus", uid="${datasource}")
LOKI = DataSourceRef(type_val="loki", uid="${loki}")
SEL = 'instance=~"$instance", model_name=~"$model"'
RATE = "[$__rate_interval]"
OPS = "docs/operations.md"

# error_type values answered with 5xx (engine failures, drain, internal errors) and aborts by
# the client; every other error_type is a 4xx client error (see entrypoints/errors.py).
SERVER_ERRORS = (
    "engine_dead|shutting_down|aborted_by_engine|internal_server_error|service_unavailable_error"
)
ABORTS = "aborted|client_disconnected"

# Health state as one number per instance: starting contributes 0.
HEALTH_CODE = (
    "sum by (instance, model_name) ("
    f'otel_engine_engine_health_state{{{SEL}, state="healthy"}}'
    f' or otel_engine_engine_health_state{{{SEL}, state="draining"}} * 2'
    f' or otel_engine_engine_health_state{{{SEL}, state="dead"}} * 3'
    f' or otel_engine_engine_health_state{{{SEL}, state="stalled"}} * 4)'
)
HEALTH_MAPPINGS: list[mdash.ValueMapping] = [
    mdash.ValueMap(
        options={
            "0": mdash.ValueMappingResult(text="starting", color="blue", index=0),
            "1": mdash.ValueMappingResult(text="healthy", color="green", index=1),
            "2": mdash.ValueMappingResult(text="draining", color="orange", index=2),
            "3": mdash.ValueMappingResult(text="dead", color="red", index=3),
            "4": mdash.ValueMappingResult(text="stalled", color="purple", index=4),
        }
    )
]

CRASH_ANNOTATION = (
    f'max by (instance) (max_over_time(otel_engine_engine_health_state{{{SEL}, state="dead"}}'
    "[1m])) > 0 or sum by (instance) (increase(otel_engine_request_errors_total"
    f'{{{SEL}, error_type="engine_dead"}}[1m])) > 0'
)
CRASH_LOG_QUERY = '{service_name="otel-engine"} |= "engine_crash_dump"'

AFTER_CRASH_ONLY: frozenset[str] = frozenset({CRASH_ANNOTATION})
"""Exprs (as in the JSON) that only return data after an engine crash; all others return data
on a healthy server under load."""

_VARIABLES = re.compile(
    r"\$(?:\{(__rate_interval|__interval|__range|instance|model)(?::\w+)?\}"
    r"|(__rate_interval|__interval|__range|instance|model)(?!\w))"
)
_VALUES = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "5m",
    "instance": ".*",
    "model": ".*",
}
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NOT_IN_SCHEMA = ("auto", "auto_count", "auto_min", "definition")
_LABEL_VALUES = re.compile(r"label_values\((.*?)(?:,\s*\w+)?\)\s*$")


def substitute(expr: str) -> str:
    """`expr` with Grafana's variables replaced by concrete values, so Prometheus can run it."""
    return _VARIABLES.sub(lambda m: _VALUES[m.group(1) or m.group(2)], expr)


# ---------------------------------------------------------------------------- query helpers


def target(expr: str, legend: str, *, exemplar: bool = False) -> prometheus.Dataquery:
    """One Prometheus target on the `${datasource}` variable."""
    query = prometheus.Dataquery().datasource(PROM).expr(expr).legend_format(legend)
    return query.exemplar(exemplar) if exemplar else query


def quantile(q: float, metric: str) -> str:
    """PromQL for the q-quantile of histogram `metric` across the selected instances."""
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{SEL}}}{RATE})))"


def percentiles(metric: str, *, exemplar: bool) -> list[prometheus.Dataquery]:
    """p50/p95/p99 targets of a histogram."""
    return [
        target(quantile(q, metric), f"p{round(q * 100)}", exemplar=exemplar)
        for q in (0.5, 0.95, 0.99)
    ]


def rate_sum(metric: str, matchers: str = "", by: str = "") -> str:
    """`sum [by (...)] (rate(metric{selection, matchers}[$__rate_interval]))`."""
    extra = f", {matchers}" if matchers else ""
    grouping = f" by ({by}) " if by else ""
    return f"sum{grouping}(rate({metric}{{{SEL}{extra}}}{RATE}))"


def mean_ratio(metric: str) -> str:
    """Mean of a histogram over the rate window: rate(sum) / rate(count)."""
    return f"{rate_sum(metric + '_sum')} / {rate_sum(metric + '_count')}"


# ---------------------------------------------------------------------------- panel helpers


def graph(
    title: str,
    description: str,
    unit: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    width: int = 12,
    min_val: float | None = 0,
    max_val: float | None = None,
    stacked: bool = False,
) -> timeseries.Panel:
    """A time series panel with its legend shown and a fixed height."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .height(8)
        .span(width)
        .fill_opacity(10)
        .legend(
            gcommon.VizLegendOptions()
            .show_legend(True)
            .display_mode(mcommon.LegendDisplayMode.LIST)
            .placement(mcommon.LegendPlacement.BOTTOM)
        )
        .tooltip(gcommon.VizTooltipOptions().mode(mcommon.TooltipDisplayMode.MULTI))
        .targets(list(targets))
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    if stacked:
        panel = panel.stacking(gcommon.StackingConfig().mode(mcommon.StackingMode.NORMAL))
    return panel


def single_stat(
    title: str,
    description: str,
    unit: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    width: int = 6,
    red_from: float | None = None,
    mappings: list[mdash.ValueMapping] | None = None,
) -> stat.Panel:
    """A stat panel of the last value; turns red at `red_from` when given."""
    steps = [mdash.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(mdash.Threshold(value=red_from, color="red"))
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .unit(unit)
        .height(6)
        .span(width)
        .graph_mode(mcommon.BigValueGraphMode.NONE)
        .color_mode(mcommon.BigValueColorMode.BACKGROUND)
        .reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(gdash.ThresholdsConfig().mode(mdash.ThresholdsMode.ABSOLUTE).steps(steps))
        .targets(list(targets))
    )
    return panel.mappings(mappings) if mappings else panel


def health_timeline(description: str) -> statetimeline.Panel:
    """The engine health state of each instance over time, one colored band per state."""
    return (
        statetimeline.Panel()
        .title("Engine health state")
        .description(description)
        .unit("short")
        .height(6)
        .span(24)
        .mappings(HEALTH_MAPPINGS)
        .show_value(mcommon.VisibilityMode.AUTO)
        .targets([target(HEALTH_CODE, "{{instance}} {{model_name}}")])
    )


def row(title: str, panels: Sequence[Any], *, collapsed: bool = False) -> gdash.Row:
    """A row holding `panels`; `_finish` hoists those of an expanded row to the top level."""
    built = gdash.Row(title)
    for panel in panels:
        built = built.with_panel(panel)
    return built.collapsed(collapsed)  # with_panel() collapses the row; undo that


def variables() -> list[Any]:
    """datasource, loki, instance and model: the names shared with deploy/ and the docs."""
    return [
        gdash.DatasourceVariable("datasource")
        .label("Prometheus")
        .type("prometheus")
        .current(mdash.VariableOption(selected=True, text="Prometheus", value="prometheus")),
        gdash.DatasourceVariable("loki")
        .label("Loki")
        .type("loki")
        .current(mdash.VariableOption(selected=True, text="Loki", value="loki")),
        _label_variable(
            "instance", "Instance", "label_values(otel_engine_engine_health_state, instance)"
        ),
        _label_variable(
            "model",
            "Model",
            'label_values(otel_engine_engine_health_state{instance=~"$instance"}, model_name)',
        ),
    ]


def _label_variable(name: str, label: str, query: str) -> gdash.QueryVariable:
    """A multi-value label variable whose "All" matches everything (`.*`)."""
    return (
        gdash.QueryVariable(name)
        .label(label)
        .datasource(PROM)
        .query(query)
        .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(mdash.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(mdash.VariableOption(selected=True, text="All", value="$__all"))
    )


def annotations() -> list[gdash.AnnotationQuery]:
    """Engine crashes from Prometheus (health dead or engine_dead errors) and crash-dump logs."""
    return [
        gdash.AnnotationQuery()
        .name("Engine crash")
        .datasource(PROM)
        .target(prometheus.Dataquery().ref_id("Anno").expr(CRASH_ANNOTATION).interval("10s"))
        .title_format("Engine crash on {{instance}}")
        .text_format("Health went dead or requests failed with engine_dead; see Crash dumps.")
        .tag_keys("instance")
        .enable(True)
        .icon_color("red"),
        gdash.AnnotationQuery()
        .name("Crash dump log")
        .datasource(LOKI)
        .target(loki.Dataquery().ref_id("Anno").expr(CRASH_LOG_QUERY))
        .enable(True)
        .icon_color("purple"),
    ]


def dashboard(uid: str, title: str, description: str, rows: Sequence[gdash.Row]) -> dict[str, Any]:
    """A dashboard with the shared variables, annotations, time range and refresh."""
    built = (
        gdash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["otel-engine"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(mdash.DashboardCursorSync.CROSSHAIR)
        .variables(variables())
        .annotations(annotations())
        .link(
            gdash.DashboardLink("otel-engine dashboards")
            .type(mdash.DashboardLinkType.DASHBOARDS)
            .tags(["otel-engine"])
            .as_dropdown(True)
            .include_vars(True)
            .keep_time(True)
        )
    )
    for each in rows:
        built = built.with_row(each)
    return _finish(json.loads(json.dumps(built.build(), cls=JSONEncoder)))


def _finish(board: dict[str, Any]) -> dict[str, Any]:
    """Hoist the panels of expanded rows to the top level (where Grafana expects them) and
    number every panel, so ids are unique and stable."""
    flat: list[dict[str, Any]] = []
    for panel in board.get("panels", []):
        nested = panel.get("panels", []) if panel.get("type") == "row" else []
        if panel.get("type") == "row" and not panel.get("collapsed"):
            panel["panels"] = []
            flat.append(panel)
            flat.extend(nested)
        else:
            flat.append(panel)
    for number, panel in enumerate(_all_panels(flat), start=1):
        panel["id"] = number
        for letter, query in zip(REF_IDS, panel.get("targets", []), strict=False):
            query.setdefault("refId", letter)
    board["panels"] = flat
    for var in board.get("templating", {}).get("list", []):
        for key in _NOT_IN_SCHEMA:  # SDK defaults that @grafana/schema's VariableModel lacks
            var.pop(key, None)
    return board


def _all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows, in order."""
    for panel in panels:
        yield panel
        yield from panel.get("panels", [])


# ---------------------------------------------------------------------------- the dashboards

HEALTH_DESCRIPTION = (
    "Health state of each engine (otel_engine_engine_health_state): starting, healthy, "
    "draining (SIGTERM received, finishing in-flight requests), stalled (requests pending and "
    "no step finished within --step-timeout: /health answers 503 engine_stalled; a few seconds "
    "later the engine is given up and turns dead) or dead (the engine core or a worker failed; "
    "the api_server fails every in-flight request and exits with code 1). "
    "If it shows stalled: a hung worker or collective, or a --step-timeout too short for the "
    "longest prefill; the crash dump that follows says which. "
    "If it shows dead: open the Engine & failures dashboard, read the crash dump log line and "
    "follow its trace_id to the failing engine_core.step span (docs/operations.md, "
    "'Reading a crash'). Draining that never ends: in-flight requests outlive "
    "--shutdown-timeout. A gap means the server was not scraped (see Scrape health)."
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
        ],
    )
    return dashboard(
        "otel-engine-overview",
        "otel-engine / Serving overview",
        "Traffic, errors, latency (with exemplars linking to traces), tokens and capacity of "
        "otel-engine. Engine internals and crashes: otel-engine / Engine & failures.",
        [traffic, latency, capacity],
    )


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
        "dumps from Loki linked to their traces, and the engine step internals.",
        [failed, engine],
    )


def build_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON (plain dicts), the same on every call."""
    return {OVERVIEW: overview(), FAILURES: failures()}


def render(board: dict[str, Any]) -> str:
    """The committed form: sorted keys, two-space indent, trailing newline."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------- query listing


def prometheus_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, or "annotation:<name>" / "variable:<name>", expr) of every PromQL
    expression in `dashboard`; for query variables, the selector inside label_values()."""
    found: list[tuple[str, str]] = []
    for panel in _all_panels(dashboard.get("panels", [])):
        panel_ds = panel.get("datasource") or {}
        for query in panel.get("targets", []):
            ds = query.get("datasource") or panel_ds
            if ds.get("type") == "prometheus" and query.get("expr"):
                found.append((panel.get("title", ""), query["expr"]))
    for note in dashboard.get("annotations", {}).get("list", []):
        expr = note.get("expr") or (note.get("target") or {}).get("expr")
        if (note.get("datasource") or {}).get("type") == "prometheus" and expr:
            found.append((f"annotation:{note['name']}", expr))
    for var in dashboard.get("templating", {}).get("list", []):
        is_prom = (var.get("datasource") or {}).get("type") == "prometheus"
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and is_prom and isinstance(query, str):
            match = _LABEL_VALUES.match(query.strip())
            found.append((f"variable:{var['name']}", match.group(1) if match else query))
    return found


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards, or with --check report (exit 1) the first stale or missing one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a committed JSON file is stale"
    )
    args = parser.parse_args(argv)
    stale = []
    for name, board in build_dashboards().items():
        path = HERE / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    for name in stale:
        print(f"dashboards/{name} is stale: run `python dashboards/generate.py`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
