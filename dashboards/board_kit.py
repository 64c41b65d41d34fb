"""The building blocks of the otel-engine dashboards: the shared selectors and queries, panel
builders (grafana-foundation-sdk), the variables, the annotations and the dashboard shell.

`board_overview.py` and `board_failures.py` lay out the two dashboards with these;
`generate.py` writes them. Not a package: `generate.py` puts this directory on `sys.path`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

with warnings.catch_warnings():
    # The v1 dashboard builder warns "prefer dashboardv2" at import; Grafana's file provisioning
    # and schemaVersion 42 are the v1 model, which is what we want.
    warnings.simplefilter("ignore", DeprecationWarning)
    from grafana_foundation_sdk.builders import common as gcommon
    from grafana_foundation_sdk.builders import dashboard as gdash
    from grafana_foundation_sdk.builders import (
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

PROM = DataSourceRef(type_val="prometheus", uid="${datasource}")
LOKI = DataSourceRef(type_val="loki", uid="${loki}")
SEL = 'instance=~"$instance", model_name=~"$model"'
RATE = "[$__rate_interval]"
OPS = "docs/operations.md"

# error_type values answered with 5xx (engine failures, drain, internal errors) and aborts by
# the client; every other error_type is a 4xx client error (see entrypoints/network/errors.py).
SERVER_ERRORS = (
    "engine_dead|shutting_down|aborted_by_engine|internal_server_error|service_unavailable_error"
    "|request_failed"
)
ABORTS = "aborted|client_disconnected|client_stalled"

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
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_NOT_IN_SCHEMA = ("auto", "auto_count", "auto_min", "definition")

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
    for number, panel in enumerate(all_panels(flat), start=1):
        panel["id"] = number
        for letter, query in zip(REF_IDS, panel.get("targets", []), strict=False):
            query.setdefault("refId", letter)
    board["panels"] = flat
    for var in board.get("templating", {}).get("list", []):
        for key in _NOT_IN_SCHEMA:  # SDK defaults that @grafana/schema's VariableModel lacks
            var.pop(key, None)
    return board


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows, in order."""
    for panel in panels:
        yield panel
        yield from panel.get("panels", [])
