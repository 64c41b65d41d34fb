"""What a router in front of many replicas reads from each one: GET /get_load (vLLM's
router, power_of_two), the cache shape (`otel_engine_cache_config_info`) and, behind
`--vllm-metric-names`, the names vLLM's router, the inference gateway and vLLM dashboards read."""

from __future__ import annotations

import time

import httpx

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from tests.entrypoints.conftest import Served, ServerLoop
from tests.helpers.scrape import metric_value


def test_get_load_counts_the_requests_in_flight(served: Served) -> None:
    """`{"load": N}`: N is the generation requests this server holds now."""
    with served.http() as http:
        assert {"load": 0} == http.get("/get_load").json()
        body = {"model": served.model, "prompt": "a", "max_tokens": 400, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)  # the first chunk: the request is in the engine
            assert {"load": 1} == http.get("/get_load").json()
            for _ in lines:
                pass
        deadline = time.monotonic() + 10
        while http.get("/get_load").json()["load"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"load": 0} == http.get("/get_load").json()


def test_cache_config_names_the_block_size_and_the_number_of_blocks(served: Served) -> None:
    """A prefix-aware scorer models each replica's cache from these two numbers."""
    value = metric_value(
        served.base_url,
        "otel_engine_cache_config_info",
        block_size="16",
        num_blocks="512",
        enable_prefix_caching="true",
    )
    assert 1 == value


def test_vllm_metric_names_beside_the_otel_engine_ones(
    server_loop: ServerLoop, engine: AsyncLLM
) -> None:
    """`--vllm-metric-names`: an existing vLLM fleet's router and dashboards read this server
    unchanged (same values, vLLM's names and label names)."""
    server = make_server(engine, drain_timeout=5, vllm_metric_names=True)
    base_url = server_loop.start(server)
    try:
        with httpx.Client(base_url=base_url, timeout=60, trust_env=False) as http:
            body = {"model": engine.model_name, "prompt": "a", "max_tokens": 3}
            assert 200 == http.post("/v1/completions", json=body).status_code
        labels = {"model_name": engine.model_name}
        assert 1 == metric_value(
            base_url, "vllm:cache_config_info", block_size="16", num_gpu_blocks="512", **labels
        )
        assert 0 == metric_value(base_url, "vllm:num_requests_waiting", **labels)
        usage = metric_value(base_url, "vllm:kv_cache_usage_perc", **labels)
        assert usage == metric_value(base_url, "otel_engine_kv_cache_usage_ratio", **labels)
        assert 0 <= usage <= 1
        success = metric_value(
            base_url, "vllm:request_success_total", finished_reason="length", **labels
        )
        assert success >= 1
        assert success == metric_value(
            base_url, "otel_engine_request_success_total", finish_reason="length", **labels
        )
    finally:
        server_loop.stop(server)
