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
`build_dashboards`, `prometheus_queries`, `substitute`, `AFTER_CRASH_ONLY` and
`CRASH_LOG_QUERY`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

# The building blocks and the two layouts live next to this script (not a package).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from board_failures import failures
from board_kit import CRASH_ANNOTATION, CRASH_LOG_QUERY, all_panels
from board_overview import overview

__all__ = [
    "AFTER_CRASH_ONLY",
    "CRASH_LOG_QUERY",
    "FAILURES",
    "OVERVIEW",
    "build_dashboards",
    "main",
    "prometheus_queries",
    "render",
    "substitute",
]

HERE = Path(__file__).resolve().parent
OVERVIEW = "otel-engine-overview.json"
FAILURES = "otel-engine-failures.json"

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
    for panel in all_panels(dashboard.get("panels", [])):
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
