"""The Grafana dashboards: committed JSON is fresh, every PromQL parses, panels are documented.

`dashboards/generate.py` is loaded by path (dashboards/ is not a package). Parsing uses
Debian's `promtool`: each expression becomes a recording rule and `promtool check rules`
parses them all in one run. That live Prometheus returns data for every query is checked by
`test_live_prometheus.py`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_engine.observability.metrics import EngineMetrics
from tests.helpers.dashboards import GENERATE, generator
from tests.helpers.tools import prometheus_tool

REQUIRED_VARIABLES = {"datasource", "loki", "instance", "model"}
# What to do: a flag to change, the operations doc, or an imperative next step.
ACTION = re.compile(
    r"--[a-z-]+|docs/operations\.md|\b(open|raise|lower|add|check|see|fix|set|read|find|collect)\b"
)
LATENCY_TITLES = {"Time to first token", "Time per output token", "End-to-end request latency"}


gen = generator()
DASHBOARDS: dict[str, dict[str, Any]] = gen.build_dashboards()


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and panels nested in collapsed rows included."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def _content_panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in _panels(board) if panel["type"] != "row"]


def _all_queries() -> list[tuple[str, str, str]]:
    return [
        (name, title, expr)
        for name, board in DASHBOARDS.items()
        for title, expr in gen.prometheus_queries(board)
    ]


def _promtool_check(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess[str]:
    """`promtool check rules` on one recording rule per expr (check:panel_N)."""
    promtool = prometheus_tool("promtool")
    rules = [{"record": f"check:panel_{n}", "expr": expr} for n, expr in enumerate(exprs)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_committed_json_is_fresh(name: str) -> None:
    """The committed JSON is exactly what generate.py builds."""
    committed = GENERATE.parent / name
    assert committed.exists(), f"dashboards/{name} is missing: run `python dashboards/generate.py`"
    assert gen.render(DASHBOARDS[name]) == committed.read_text(encoding="utf-8"), (
        f"dashboards/{name} is stale: run `python dashboards/generate.py`"
    )


def test_no_uncommitted_dashboard_files() -> None:
    """Every dashboards/*.json is one that generate.py builds (none left over from a rename)."""
    assert set(DASHBOARDS) == {path.name for path in GENERATE.parent.glob("*.json")}


def test_build_is_deterministic() -> None:
    """Two builds give the same text, so the staleness check cannot flap."""
    again = gen.build_dashboards()
    assert {n: gen.render(b) for n, b in DASHBOARDS.items()} == {
        n: gen.render(b) for n, b in again.items()
    }


def test_check_flag_names_the_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate.py --check` exits 1 and names the file that differs; 0 when all are fresh."""
    monkeypatch.setattr(gen, "HERE", tmp_path)
    assert 0 == gen.main([])
    assert 0 == gen.main(["--check"])
    stale = sorted(DASHBOARDS)[0]
    (tmp_path / stale).write_text("{}\n")
    assert 1 == gen.main(["--check"])
    assert f"dashboards/{stale} is stale" in capsys.readouterr().err


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    """Each PromQL expression, variables substituted, is a valid recording rule."""
    queries = _all_queries()
    assert len(queries) > 20
    exprs = [gen.substitute(expr) for _, _, expr in queries]
    result = _promtool_check(tmp_path, exprs)
    where = "\n".join(
        f"check:panel_{n} = {name} / {title}: {expr}"
        for n, (name, title, expr) in enumerate(queries)
    )
    assert 0 == result.returncode, f"{result.stdout}{result.stderr}\n{where}"


def test_promtool_rejects_a_broken_query(tmp_path: Path) -> None:
    """The parse check is real: a query with an unbalanced parenthesis fails it."""
    result = _promtool_check(tmp_path, ["sum(rate(otel_engine_prompt_tokens_total[1m])"])
    assert 0 != result.returncode
    assert "check:panel_0" in result.stdout + result.stderr


def test_substitute_leaves_no_grafana_variables() -> None:
    """Prometheus gets no `$` left over, and each variable form becomes its concrete value."""
    for _, _, expr in _all_queries():
        assert "$" not in gen.substitute(expr), expr
    assert 'a{i=~".*", m=~".*"}[1m] [1m] [5m] ".*"' == gen.substitute(
        'a{i=~"$instance", m=~"${model}"}[$__rate_interval] [$__interval] [$__range] '
        '"${instance:regex}"'
    )


def test_after_crash_only_names_real_queries() -> None:
    """AFTER_CRASH_ONLY holds the crash annotation and nothing that is not in a dashboard."""
    exprs = {expr for _, _, expr in _all_queries()}
    assert gen.AFTER_CRASH_ONLY
    assert gen.AFTER_CRASH_ONLY <= exprs
    titles = {title for _, title, expr in _all_queries() if expr in gen.AFTER_CRASH_ONLY}
    assert {"annotation:Engine crash"} == titles


def test_query_metrics_are_exported_by_the_engine() -> None:
    """Every otel_engine_* series a query reads is one EngineMetrics exposes (no typos)."""
    text = EngineMetrics(model_name="m", process_metrics=True).render()[0].decode()
    exposed = set(re.findall(r"^(otel_engine_\w+)", text, flags=re.MULTILINE))
    used = {name for _, _, expr in _all_queries() for name in re.findall(r"otel_engine_\w+", expr)}
    assert set() == used - exposed


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_panel_says_what_it_shows_and_what_to_do(name: str) -> None:
    """Each panel has a description of what it shows and what to do when it looks wrong."""
    for panel in _content_panels(DASHBOARDS[name]):
        description = panel.get("description", "")
        assert len(description) > 80, f"{panel['title']}: {description!r}"
        assert ACTION.search(description), f"{panel['title']}: says nothing to do"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboard_structure(name: str) -> None:
    """Schema 42, uid and title, the shared variables, `${datasource}` targets, unique ids."""
    board = DASHBOARDS[name]
    assert 42 == board["schemaVersion"]
    assert board["uid"]
    assert board["title"]
    assert ("now-1h", "10s") == (board["time"]["from"], board["refresh"])
    variables = {var["name"]: var for var in board["templating"]["list"]}
    assert REQUIRED_VARIABLES <= set(variables)
    assert ("datasource", "prometheus") == (
        variables["datasource"]["type"],
        variables["datasource"]["query"],
    )
    assert ("datasource", "loki") == (variables["loki"]["type"], variables["loki"]["query"])
    for var in ("instance", "model"):
        assert (True, True, ".*") == (
            variables[var]["multi"],
            variables[var]["includeAll"],
            variables[var]["allValue"],
        )
    ids = [panel["id"] for panel in _panels(board)]
    assert len(ids) == len(set(ids))
    for panel in _content_panels(board):
        for query in panel.get("targets", []):
            if "loki" != panel.get("datasource", {}).get("type"):
                assert {"type": "prometheus", "uid": "${datasource}"} == query["datasource"]
        if panel["type"] != "logs":
            assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]


def test_dashboard_uids_are_distinct() -> None:
    assert len(DASHBOARDS) == len({board["uid"] for board in DASHBOARDS.values()})


def test_latency_panels_enable_exemplars() -> None:
    """Percentile panels in seconds ask for exemplars, which link a point to its trace."""
    checked = set()
    for board in DASHBOARDS.values():
        for panel in _content_panels(board):
            targets = panel.get("targets", [])
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            is_latency = unit == "s" and any(
                "histogram_quantile" in query.get("expr", "") for query in targets
            )
            if is_latency:
                checked.add(panel["title"])
                assert all(query.get("exemplar") is True for query in targets), panel["title"]
    assert LATENCY_TITLES <= checked


def test_crash_dump_logs_panel_reads_loki() -> None:
    """The crash-dump panel queries `${loki}` for engine_crash_dump lines and links by trace_id."""
    logs = [
        panel
        for board in DASHBOARDS.values()
        for panel in _content_panels(board)
        if panel["type"] == "logs"
    ]
    assert 1 == len(logs)
    assert {"type": "loki", "uid": "${loki}"} == logs[0]["datasource"]
    assert [gen.CRASH_LOG_QUERY] == [query["expr"] for query in logs[0]["targets"]]
    assert "engine_crash_dump" in gen.CRASH_LOG_QUERY
    assert "trace_id" in logs[0]["description"]


def _typescript_check(
    out_dir: Path, json_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`node dashboards/ts/check.mjs`: tsc --strict of the dashboards against @grafana/schema."""
    node = shutil.which("node")
    if node is None or shutil.which("npm") is None:
        pytest.skip("node/npm are not installed")
    ts_dir = GENERATE.parent / "ts"
    if not (ts_dir / "node_modules" / "@grafana" / "schema").is_dir():
        pytest.skip("run `npm ci --prefix dashboards/ts` first (tests do not use the network)")
    command = [node, str(ts_dir / "check.mjs"), str(out_dir)]
    if json_dir is not None:
        command.append(str(json_dir))
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_dashboards_type_check_against_grafana_schema(tmp_path: Path) -> None:
    """Every dashboard, panel options and field config included, is a strict @grafana/schema
    value: no unknown keys, no values outside their enums."""
    result = _typescript_check(tmp_path)
    assert 0 == result.returncode, result.stdout + result.stderr


def test_typescript_check_rejects_a_bad_dashboard(tmp_path: Path) -> None:
    """The type check is real: an unknown option key and an out-of-enum value fail it."""
    board = gen.build_dashboards()[gen.OVERVIEW]
    timeseries = next(panel for panel in board["panels"] if panel["type"] == "timeseries")
    timeseries["options"]["legend"]["displayMode"] = "bogus"
    timeseries["fieldConfig"]["defaults"]["custom"]["fillOpacty"] = 10
    json_dir = tmp_path / "json"
    json_dir.mkdir()
    (json_dir / "bad.json").write_text(gen.render(board))
    result = _typescript_check(tmp_path / "ts", json_dir)
    assert 0 != result.returncode
    assert {"bogus", "fillOpacty"} <= set(re.findall(r"bogus|fillOpacty", result.stdout))


def _logql_check(*args: str) -> subprocess.CompletedProcess[str]:
    """`node dashboards/ts/logql.mjs`: every LogQL query parsed by Grafana's LogQL grammar."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    ts_dir = GENERATE.parent / "ts"
    if not (ts_dir / "node_modules" / "@grafana" / "lezer-logql").is_dir():
        pytest.skip("run `npm ci --prefix dashboards/ts` first (tests do not use the network)")
    return subprocess.run(
        [node, str(ts_dir / "logql.mjs"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_every_logql_query_parses() -> None:
    """The Loki panel and annotations (promtool cannot check them) parse as LogQL."""
    result = _logql_check()
    assert 0 == result.returncode, result.stdout + result.stderr
    num_queries = int(result.stdout.split(" LogQL queries")[0].split()[-1])
    assert num_queries >= 3  # the Crash dumps panel and one annotation per dashboard


def test_logql_check_rejects_a_broken_query() -> None:
    """The parse check is real: an unclosed stream selector fails it."""
    result = _logql_check("--query", gen.CRASH_LOG_QUERY, '{service_name="otel-engine" |= "x"')
    assert 1 == result.returncode
    assert "query 1: LogQL syntax error" in result.stdout
    assert "query 0" not in result.stdout
