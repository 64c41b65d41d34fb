"""Decode speed against the machine's limit, in a real server at TP=1: the probe measured
at start (and cached beside the kernel builds), the last decode-only step's bandwidth in
/metrics, GET /v1/models and the crash dump. TP=2 (rank 0 through the workers' ready
message) and the step span: test_server_telemetry.py. `DecodeBandwidth` on its own first."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_engine.model.bandwidth import MemoryBandwidth
from otel_engine.observability.decode_bandwidth import WINDOW_S, DecodeBandwidth
from tests.helpers.procs import ServerProcess

RATIO_BOUND = 4.0  # a step can beat memory only where the model fits in the caches
LONG_PROMPT = list(range(300, 350))  # its prefill is the step that faults
GAUGES = (
    "otel_engine_memory_read_bandwidth_bytes_per_second",
    "otel_engine_decode_bandwidth_bytes_per_second",
    "otel_engine_decode_bandwidth_ratio",
)


def gauges(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in GAUGES
    }


def test_only_a_step_of_decodes_alone_has_a_decode_bandwidth() -> None:
    """A step with a prefill chunk reads as much but is bound by arithmetic: 0, and the
    decode-only step's value stays what the card and the dump show."""
    bandwidth = DecodeBandwidth(MemoryBandwidth(20e9, 2, "cpu", 256 << 20))

    decode = bandwidth.of_step(10_000_000, 0.005, is_decode_only=True)
    prefill = bandwidth.of_step(10_000_000, 0.05, is_decode_only=False)

    assert (2e9, 0.0) == (decode, prefill)
    assert {"decode_bytes_per_second": 2_000_000_000, "decode_ratio": 0.1} == {
        key: bandwidth.part()[key] for key in ("decode_bytes_per_second", "decode_ratio")
    }


def test_the_recent_bandwidth_is_the_last_second_of_decode_steps_together() -> None:
    """Steps older than WINDOW_S of decode time drop out; the rest count by their bytes."""
    bandwidth = DecodeBandwidth(None)
    bandwidth.observe(1e9, 0.9)
    bandwidth.observe(3e9, 0.5)
    both = bandwidth.recent
    bandwidth.observe(3e9, 0.6)

    assert WINDOW_S == 1.0
    assert (0.9e9 + 1.5e9) / 1.4 == pytest.approx(both)
    assert 3e9 == pytest.approx(bandwidth.recent)


def test_without_a_measured_peak_there_is_no_ratio() -> None:
    """On CUDA (no probe) the bandwidth is still said, its ratio is not."""
    bandwidth = DecodeBandwidth(None)
    bandwidth.observe(3e9, 0.01)

    assert (None, 3_000_000_000, None) == (
        bandwidth.part()["peak_bytes_per_second"],
        bandwidth.part()["decode_bytes_per_second"],
        bandwidth.part()["decode_ratio"],
    )


@pytest.mark.slow  # starts a server
def test_metrics_card_and_dump_show_the_measured_peak_and_the_last_decode_step(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """A fresh cache: the server probes and caches its peak; after a decode request the
    gauges, the card and, after a later fault, the dump show the same peak and a decode
    bandwidth above 0 at a ratio of at most RATIO_BOUND."""
    cache, dump_dir = tmp_path / "cache", tmp_path / "dumps"
    args = ["--model", tiny_model_dir, "--num-kv-blocks", "64", "--kernels", "torch"]
    args += ["--crash-dump-dir", str(dump_dir)]
    env = {
        "OTEL_ENGINE_CACHE_DIR": str(cache),
        "OTEL_ENGINE_FAULT": f"engine_core:raise:when=num_tokens>={len(LONG_PROMPT)}",
    }
    with ServerProcess(args, env=env) as server:
        server.wait_healthy()
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            before = gauges(client.get("/metrics").text)
            model = client.get("/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
            assert 200 == client.post("/v1/completions", json=body).status_code
            after = gauges(client.get("/metrics").text)
            card = client.get("/v1/models").json()["data"][0]["memory_bandwidth"]
            crashed = client.post("/v1/completions", json={**body, "prompt": LONG_PROMPT})
        server.wait(timeout=60)
    (cached,) = (cache / "bandwidth").glob("read-*.json")
    peak = json.loads(cached.read_text())["bytes_per_second"]
    (dump_file,) = dump_dir.glob("crash-*.json")
    dumped = json.loads(dump_file.read_text())["system_stats"]["memory_bandwidth"]

    assert 500 == crashed.status_code
    assert (round(peak), False) == (card["peak_bytes_per_second"], card["peak_is_cached"])
    assert peak == before[GAUGES[0]] == after[GAUGES[0]]
    assert (0.0, 0.0) == (before[GAUGES[1]], before[GAUGES[2]])
    assert 0 < after[GAUGES[1]]
    assert 0 < after[GAUGES[2]] <= RATIO_BOUND
    assert after[GAUGES[2]] == pytest.approx(after[GAUGES[1]] / peak)
    assert 0 < card["decode_bytes_per_second"]
    assert 0 < card["decode_ratio"] <= RATIO_BOUND
    assert card["peak_bytes_per_second"] == dumped["peak_bytes_per_second"]
    assert 0 < dumped["decode_bytes_per_second"]
    assert 0 < dumped["decode_ratio"] <= RATIO_BOUND
