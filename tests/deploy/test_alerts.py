"""The alerting rules of deploy/compose/alerts.yml: they parse, their unit tests pass
(`promtool test rules` on tests/deploy/alerts_test.yml: each alert fires on the series a
failure leaves and stays quiet on a healthy engine), and each one says what to do."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.paths import REPO_ROOT
from tests.helpers.tools import prometheus_tool

RULES = REPO_ROOT / "deploy" / "compose" / "alerts.yml"
UNIT_TESTS = Path(__file__).resolve().parent / "alerts_test.yml"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


def test_rules_parse() -> None:
    result = subprocess.run(
        [prometheus_tool("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    """Every alert has a scenario where it fires and the healthy scenario where it does not."""
    result = subprocess.run(
        [prometheus_tool("promtool"), "test", "rules", UNIT_TESTS.name],
        capture_output=True,
        text=True,
        check=False,
        cwd=UNIT_TESTS.parent,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tested
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    quiet = {
        case["alertname"]
        for test in tested
        if test["name"] == "healthy"
        for case in test["alert_rule_test"]
        if not case.get("exp_alerts")
    }
    names = {rule["alert"] for rule in _alerts()}
    assert fired == names
    assert quiet == names


def test_every_alert_says_what_to_do() -> None:
    """Severity, a summary, a description, and a runbook anchor that exists in the docs."""
    anchors = _anchors(OPERATIONS.read_text())
    for rule in _alerts():
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"], rule["alert"]
        assert len(annotations["description"]) > 40, rule["alert"]
        path, _, anchor = annotations["runbook"].partition("#")
        assert (REPO_ROOT / path) == OPERATIONS, rule["alert"]
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor}"


def test_alerts_only_use_exported_metrics() -> None:
    """A renamed metric would silence an alert: every otel_engine_* name in an expr exists."""
    from otel_engine.observability.metrics import EngineMetrics

    body, _ = EngineMetrics(model_name="m", process_metrics=True).render()
    exported = set(re.findall(r"^(otel_engine_\w+)", body.decode(), flags=re.MULTILINE))
    for rule in _alerts():
        for name in re.findall(r"otel_engine_\w+", rule["expr"]):
            assert name in exported, f"{rule['alert']}: {name}"
