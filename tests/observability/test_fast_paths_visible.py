"""An operator sees which fast paths each rank of a server runs without reading its logs:
`GET /v1/models`, the `otel_engine_fast_path_info` metric and the crash dump say what each
rank's start log `kernels.selected` said."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts a server


@pytest.mark.parametrize("tp", [1, 2])
def test_models_metrics_and_dump_show_every_ranks_logged_plan(
    tiny_model_dir: str, tp: int, tmp_path: Path
) -> None:
    """Each rank's plan, as it logged it, by rank, in /v1/models, the metric (a `rank`
    label) and the dump of a failure that comes later; ranks on one machine do not differ."""
    dump_dir = tmp_path / "dumps"
    args = ["--model", tiny_model_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64"]
    args += ["--tensor-parallel-size", str(tp), "--log-level", "INFO"]
    args += ["--crash-dump-dir", str(dump_dir)]
    fault = f"worker:raise:rank={tp - 1}:when=num_requests>=1"  # the first request's step
    with ServerProcess(args, env={"OTEL_ENGINE_FAULT": fault}) as server:
        server.wait_healthy()
        card = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        failed = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": card["id"], "prompt": "Hello", "max_tokens": 2},
            timeout=60,
        )
        server.wait(timeout=60)
        logged = [r for r in server.json_lines() if r.get("event") == "kernels.selected"]

    plans = card["fast_paths"]
    assert (tp, False, []) == (len(plans["ranks"]), plans["ranks_differ"], plans["differences"])
    assert list(range(tp)) == sorted(r["rank"] for r in logged)  # one line per rank
    for rank, plan in enumerate(plans["ranks"]):
        (line,) = [r for r in logged if r["rank"] == rank]
        assert plan == {key: line[key] for key in plan}
        assert plan["paths"]
    samples = {
        (s.labels["path"], int(s.labels["rank"])): s.labels
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "otel_engine_fast_path_info"
    }
    shown = {(path, rank) for rank, plan in enumerate(plans["ranks"]) for path in plan["paths"]}
    assert shown == set(samples)
    for (path, rank), labels in samples.items():
        plan = plans["ranks"][rank]
        expected = "true" if plan["paths"][path]["enabled"] else "false"
        assert (expected, plan["cpu_isa"]) == (labels["enabled"], labels["cpu_isa"])
    assert 500 <= failed.status_code
    (dump_file,) = dump_dir.glob("crash-*.json")
    assert plans == json.loads(dump_file.read_text())["engine_config"]["fast_paths"]
