"""An operator sees which fast paths a server runs without reading its logs: `GET /v1/models`
and the `otel_engine_fast_path_info` metric say what the start log's `kernels.selected` said."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_engine.model.fast_paths import PATHS
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts a server


@pytest.mark.parametrize("tp", [1, 2])
def test_models_and_metrics_show_the_logged_decision(tiny_model_dir: str, tp: int) -> None:
    args = ["--model", tiny_model_dir, "--dtype", "bfloat16", "--num-kv-blocks", "64"]
    args += ["--tensor-parallel-size", str(tp), "--log-level", "INFO"]
    with ServerProcess(args).start() as server:
        server.wait_healthy()
        card = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        logged = [r for r in server.json_lines() if r.get("event") == "kernels.selected"]

    assert tp == len(logged)  # one line per rank that runs the model
    rank0 = next(r for r in logged if r.get("rank") == 0)
    chosen = card["fast_paths"]
    assert (rank0["cpu_isa"], rank0["kernel_isa"], rank0["paths"]) == (
        chosen["cpu_isa"],
        chosen["kernel_isa"],
        chosen["paths"],
    )
    assert set(PATHS) == set(chosen["paths"])
    samples = {
        s.labels["path"]: s.labels
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "otel_engine_fast_path_info"
    }
    assert set(PATHS) == set(samples)
    for path, labels in samples.items():
        expected = "true" if chosen["paths"][path]["enabled"] else "false"
        assert (expected, chosen["cpu_isa"]) == (labels["enabled"], labels["cpu_isa"])
