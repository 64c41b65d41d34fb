"""The chaos ledger: every request a client sent has exactly one terminal record in each of
the server's four telemetry sources, and they agree.

A client names each request by the trace id of the W3C `traceparent` it sends (the HTTP
server span is its child, the request's GenAI span the HTTP span's child, and every log line
of the request carries the trace id), so no source needs the server's request id to be
found. The sources, per request:

1. what the client got (`Sent`): a finish reason, an OpenAI error code, or nothing (it hung
   up on purpose, or the connection was lost);
2. the request span (`gen_ai.operation.name` set): `error.type` where it failed, else its
   finish reasons; a request refused before admission has no request span;
3. the `request.finished` / `request.failed` log line: `finish_reason`, or `error_type` and
   (when the span names a cause, as an engine death does) `cause_type`;
4. the metrics `otel_engine_request_success_total{finish_reason}` and
   `otel_engine_request_errors_total{error_type}`: aggregates, so their growth over a server's
   life must equal the log's outcomes counted the same way.

`reconcile` returns a `Ledger`: the outcomes by kind and every mismatch, by source.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

FINISHED = "finished"
FAILED = "failed"
# What the server may record for a client that hung up on purpose: the abort, or the end
# the request had already reached when the server noticed.
GONE_ERRORS = ("aborted", "client_stalled")
SUCCESS_METRIC = "otel_engine_request_success_total"
ERRORS_METRIC = "otel_engine_request_errors_total"


@dataclass
class Sent:
    """One request as its client saw it."""

    trace_id: str
    kind: str
    body_index: int
    life: int  # which server process answered it (0 unless the server was started again)
    is_stream: bool
    status: int | None = None
    error: dict[str, Any] | None = None
    response_id: str | None = None
    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    tokens: dict[int, list[str]] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    is_aborted: bool = False  # the client hung up on purpose
    lost: str | None = None  # the connection failed or the client's deadline passed

    @property
    def outcome(self) -> tuple[str, str | None] | None:
        """(finished, first choice's reason) or (failed, error code); None when the client
        has no answer (aborted or lost)."""
        if self.error is not None:
            return FAILED, self.error.get("code") or self.error.get("type")
        if self.lost is not None or self.is_aborted or not self.reasons:
            return None
        return FINISHED, self.reasons.get(0)

    @property
    def output(self) -> dict[str, Any]:
        """What must equal a fault-free run of the same body: text, finish reason and logprob
        tokens per choice, and the token counts."""
        return {
            "texts": self.texts,
            "reasons": self.reasons,
            "tokens": self.tokens,
            "usage": self.usage,
        }


@dataclass
class Ledger:
    """Outcomes by kind and the mismatches between the sources."""

    num_sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    mismatches: dict[str, list[str]] = field(
        default_factory=lambda: {"http": [], "span": [], "log": [], "metrics": []}
    )

    @property
    def num_mismatches(self) -> int:
        return sum(len(found) for found in self.mismatches.values())

    def add(self, source: str, sent: Sent, what: str) -> None:
        self.mismatches[source].append(f"{sent.kind} {sent.trace_id} life {sent.life}: {what}")


def traceparent(trace_id: str) -> str:
    """The W3C header that makes `trace_id` the request's trace (sampled)."""
    return f"00-{trace_id}-{trace_id[:16]}-01"


def log_records(lines: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """The `request.finished` / `request.failed` JSON log lines, by trace id."""
    found: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if '"request.f' not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") in ("request.finished", "request.failed") and "trace_id" in record:
            found.setdefault(record["trace_id"], []).append(record)
    return found


def request_spans(spans: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The GenAI request spans (as `OtlpReceiver.spans()` gives them), by trace id."""
    found: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if "gen_ai.operation.name" in span["attributes"]:
            found.setdefault(span["trace_id"], []).append(span)
    return found


def metric_outcomes(text: str) -> Counter[tuple[str, str]]:
    """(finished, reason) and (failed, error type) counts of a /metrics exposition."""
    counts: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == SUCCESS_METRIC:
                counts[FINISHED, sample.labels["finish_reason"]] += int(sample.value)
            elif sample.name == ERRORS_METRIC:
                counts[FAILED, sample.labels["error_type"]] += int(sample.value)
    return +counts


def _log_outcome(record: dict[str, Any]) -> tuple[str, str]:
    if record["event"] == "request.finished":
        return FINISHED, str(record["finish_reason"])
    return FAILED, str(record["error_type"])


def _span_outcome(span: dict[str, Any]) -> tuple[str, str]:
    attributes = span["attributes"]
    if "error.type" in attributes:
        return FAILED, str(attributes["error.type"])
    reasons = attributes.get("gen_ai.response.finish_reasons") or [None]
    return FINISHED, str(reasons[0])


def _check_http(ledger: Ledger, sent: Sent, record: dict[str, Any]) -> None:
    logged = _log_outcome(record)
    if sent.lost is not None:
        ledger.add("http", sent, f"lost ({sent.lost}); the log says {logged}")
    elif sent.is_aborted:
        if logged[0] == FAILED and logged[1] not in GONE_ERRORS:
            ledger.add("http", sent, f"the client hung up; the log says {logged}")
    elif sent.outcome != logged:
        ledger.add("http", sent, f"the client got {sent.outcome}; the log says {logged}")
    elif sent.response_id is not None and sent.response_id != record.get("request_id"):
        ledger.add("http", sent, f"response id {sent.response_id} != {record.get('request_id')}")


def _check_span(ledger: Ledger, sent: Sent, record: dict[str, Any], spans: list[Any]) -> None:
    if "request_id" not in record:  # refused before admission: no request span
        if spans:
            ledger.add("span", sent, f"{len(spans)} request spans for a refused request")
        return
    if len(spans) != 1:
        ledger.add("span", sent, f"{len(spans)} request spans")
        return
    logged = _log_outcome(record)
    # The span names the cause where there is one (an engine death: WorkerDied).
    expected = (
        (FAILED, str(record.get("cause_type") or logged[1])) if logged[0] == FAILED else logged
    )
    if _span_outcome(spans[0]) != expected:
        ledger.add("span", sent, f"span {_span_outcome(spans[0])}; the log says {expected}")
    is_error = "ERROR" in str(spans[0]["status"]["code"])
    if is_error != (int(record.get("status", 200)) >= 500):
        ledger.add("span", sent, f"span status {spans[0]['status']} for {record.get('status')}")


def reconcile(
    sent: list[Sent],
    logs: dict[str, list[dict[str, Any]]],
    spans: dict[str, list[dict[str, Any]]],
    metrics: Counter[tuple[str, str]],
) -> Ledger:
    """Check every sent request against the three server-side sources; `metrics` is the
    growth of the outcome counters over the same requests (summed over server lives)."""
    ledger = Ledger(num_sent=len(sent))
    logged: Counter[tuple[str, str]] = Counter()
    for request in sent:
        records = logs.get(request.trace_id, [])
        outcome = "lost" if request.lost else "aborted by client" if request.is_aborted else None
        if len(records) != 1:
            ledger.add("log", request, f"{len(records)} request.finished/failed lines")
            ledger.outcomes[outcome or str(request.outcome)] += 1
            continue
        record = records[0]
        logged[_log_outcome(record)] += 1
        server = ":".join(_log_outcome(record))
        ledger.outcomes[f"{outcome} (server: {server})" if outcome else server] += 1
        _check_http(ledger, request, record)
        _check_span(ledger, request, record, spans.get(request.trace_id, []))
    for key in sorted(set(logged) | set(metrics)):
        if logged[key] != metrics[key]:
            ledger.mismatches["metrics"].append(
                f"{key}: metrics {metrics[key]}, the log's requests {logged[key]}"
            )
    return ledger


@dataclass
class Comparison:
    """Completed answers compared with a fault-free run of the same bodies."""

    num_requests: int = 0
    num_tokens: int = 0  # completion tokens compared
    num_different: int = 0
    chars_duplicated: int = 0  # in an answer, not in the fault-free one
    chars_missing: int = 0  # in the fault-free answer, not in this one
    examples: list[str] = field(default_factory=list)


def compare_outputs(sent: Iterable[Sent], reference: dict[int, dict[str, Any]]) -> Comparison:
    """Every completed `Sent` of a body in `reference` (its fault-free output) against it."""
    comparison = Comparison()
    for request in sent:
        expected = reference.get(request.body_index)
        if expected is None or request.outcome is None or request.outcome[0] != FINISHED:
            continue
        comparison.num_requests += 1
        comparison.num_tokens += (request.usage or {}).get("completion_tokens", 0)
        if request.output == expected:
            continue
        comparison.num_different += 1
        for index, text in expected["texts"].items():
            got = request.texts.get(index, "")
            for tag, i1, i2, j1, j2 in SequenceMatcher(None, text, got).get_opcodes():
                comparison.chars_missing += (i2 - i1) if tag in ("delete", "replace") else 0
                comparison.chars_duplicated += (j2 - j1) if tag in ("insert", "replace") else 0
        if len(comparison.examples) < 5:
            comparison.examples.append(
                f"{request.kind} body {request.body_index} {request.trace_id}: "
                f"{request.output!r} != {expected!r}"
            )
    return comparison
