"""OTLP export of a Prometheus registry: one source of truth for `/metrics` and OTLP.

`start_otlp_metrics()` starts thread `otlp-metrics`, which every
`OTEL_METRIC_EXPORT_INTERVAL` milliseconds (default 60000) converts the registry's current
values to OpenTelemetry metric data (counters -> monotonic cumulative sums, gauges ->
gauges, histograms -> cumulative explicit-bucket histograms, same names and labels) and
hands them to the SDK's OTLP metric exporter. Nothing runs on the request path; with no
endpoint nothing starts at all. `shutdown_telemetry()` exports once more and stops it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import defaultdict
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client import CollectorRegistry

from otel_engine.config import ObservabilityConfig
from otel_engine.ipc.roles import ProcessRole
from otel_engine.observability.otlp_export import is_enabled, make_exporter
from otel_engine.observability.tracing import build_resource, register_closer

logger = logging.getLogger(__name__)
_CUMULATIVE = AggregationTemporality.CUMULATIVE
_SCOPE = InstrumentationScope("otel_engine")


def registry_to_metrics(registry: CollectorRegistry, start_ns: int) -> list[Metric]:
    """The registry's families as OTel metrics (empty families are left out)."""
    now = time.time_ns()
    metrics = []
    for family in registry.collect():
        unit = "s" if family.name.endswith("_seconds") else ""
        if family.type == "counter":
            points = _number_points(family.samples, "_total", start_ns, now)
            data: Any = Sum(points, _CUMULATIVE, is_monotonic=True)
        elif family.type == "gauge":
            data = Gauge(_number_points(family.samples, "", start_ns, now))
        elif family.type == "histogram":
            data = Histogram(_histogram_points(family.samples, start_ns, now), _CUMULATIVE)
        else:
            continue
        if data.data_points:
            metrics.append(Metric(family.name, family.documentation, unit, data))
    return metrics


def _start_time(created: dict[tuple, float], key: tuple, default: int) -> int:
    seconds = created.get(key)
    return int(seconds * 1e9) if seconds is not None else default


def _number_points(samples: list[Any], suffix: str, start: int, now: int) -> list[Any]:
    created = {
        tuple(sorted(s.labels.items())): s.value for s in samples if s.name.endswith("_created")
    }
    points = []
    for sample in samples:
        if sample.name.endswith("_created") or (suffix and not sample.name.endswith(suffix)):
            continue
        key = tuple(sorted(sample.labels.items()))
        points.append(
            NumberDataPoint(
                dict(sample.labels), _start_time(created, key, start), now, sample.value
            )
        )
    return points


def _histogram_points(samples: list[Any], start: int, now: int) -> list[Any]:
    parts: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"buckets": []})
    for sample in samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        part = parts[tuple(sorted(labels.items()))]
        part["labels"] = labels
        if sample.name.endswith("_bucket"):
            part["buckets"].append((float(sample.labels["le"]), sample.value))
        else:
            part[sample.name.rsplit("_", 1)[1]] = sample.value
    points = []
    for part in parts.values():
        buckets = sorted(part["buckets"])
        cumulative = [int(count) for _, count in buckets]
        counts = [b - a for a, b in zip([0, *cumulative], cumulative, strict=False)]
        bounds = [bound for bound, _ in buckets if not math.isinf(bound)]
        created = part.get("created")
        points.append(
            HistogramDataPoint(
                attributes=part["labels"],
                start_time_unix_nano=int(created * 1e9) if created is not None else start,
                time_unix_nano=now,
                count=int(part.get("count", 0)),
                sum=part.get("sum", 0.0),
                bucket_counts=counts,
                explicit_bounds=bounds,
                min=None,  # type: ignore[arg-type]  # unknown to Prometheus: left unset in OTLP
                max=None,  # type: ignore[arg-type]
            )
        )
    return points


class OtlpMetricsBridge:
    """Thread `otlp-metrics`: exports `registry` every `interval_s` through `exporter`."""

    def __init__(
        self, registry: CollectorRegistry, exporter: Any, resource: Resource, interval_s: float
    ) -> None:
        self.registry = registry
        self.exporter = exporter
        self.resource = resource
        self.interval_s = interval_s
        self._start_ns = time.time_ns()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otlp-metrics", daemon=True)
        self._thread.start()

    def export_once(self, timeout_s: float = 10.0) -> bool:
        metrics = registry_to_metrics(self.registry, self._start_ns)
        data = MetricsData(
            [ResourceMetrics(self.resource, [ScopeMetrics(_SCOPE, metrics, "")], "")]
        )
        result = self.exporter.export(data, timeout_millis=max(1.0, timeout_s * 1000))
        return bool(result.name == "SUCCESS")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.export_once()
            except Exception:
                logger.warning("metrics.export_failed", exc_info=True)

    def close(self, deadline: float) -> None:
        """Stop the thread, export the final values, shut the exporter down."""
        self._stop.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.export_once(max(0.1, deadline - time.monotonic()))
        self.exporter.shutdown(timeout_millis=max(1.0, (deadline - time.monotonic()) * 1000))


def start_otlp_metrics(
    registry: CollectorRegistry,
    *,
    config: ObservabilityConfig,
    role: str = ProcessRole.API_SERVER,
    instance_id: str | None = None,
) -> OtlpMetricsBridge | None:
    """Start exporting `registry` over OTLP if a metrics endpoint is configured, else None."""
    if not is_enabled(config, "metrics"):
        return None
    interval_s = float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000")) / 1000
    bridge = OtlpMetricsBridge(
        registry,
        make_exporter(config, "metrics"),
        build_resource(role, None, instance_id),
        interval_s,
    )
    register_closer("metrics", bridge.close)
    return bridge
