"""The memory bandwidth probe (model/bandwidth.py): measured once per CPU, thread count and
probe version, then read from the cache beside the kernel builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from otel_engine.model import bandwidth
from otel_engine.model.bandwidth import PROBE_VERSION, cache_path, cpu_model, peak_read_bandwidth


def test_the_second_start_reads_the_first_ones_probe_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call measures and writes its file; the next reads that file, the same value."""
    monkeypatch.setenv("OTEL_ENGINE_CACHE_DIR", str(tmp_path))
    path = cache_path(cpu_model(), torch.get_num_threads())

    first = peak_read_bandwidth()
    written = json.loads(path.read_text())
    second = peak_read_bandwidth()

    assert first is not None
    assert second is not None
    assert (False, True) == (first.is_cached, second.is_cached)
    assert first.bytes_per_second == second.bytes_per_second == written["bytes_per_second"]
    assert 1e8 < first.bytes_per_second < 1e13  # 0.1 GB/s to 10 TB/s: a real measurement
    assert first.probe_bytes >= bandwidth.MIN_PROBE_BYTES


def test_a_file_of_another_probe_version_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached value the current probe did not measure is never used."""
    monkeypatch.setenv("OTEL_ENGINE_CACHE_DIR", str(tmp_path))
    cpu, threads = cpu_model(), torch.get_num_threads()
    path = cache_path(cpu, threads)
    path.parent.mkdir(parents=True)
    stale = {"probe_version": PROBE_VERSION - 1, "cpu": cpu, "num_threads": threads}
    path.write_text(json.dumps({**stale, "bytes_per_second": 1.0, "probe_bytes": 1}))

    measured = peak_read_bandwidth()

    assert measured is not None
    assert (False, PROBE_VERSION) == (
        measured.is_cached,
        json.loads(path.read_text())["probe_version"],
    )


def test_the_cache_is_keyed_by_cpu_and_thread_count() -> None:
    """Another thread count or CPU model is another file."""
    names = {cache_path("cpu A", 2), cache_path("cpu A", 4), cache_path("cpu B", 2)}

    assert 3 == len(names)
    assert {"bandwidth"} == {p.parent.name for p in names}


def test_the_buffer_is_well_beyond_the_last_level_cache() -> None:
    """The probe reads memory, not a cache: its buffer is several last-level caches."""
    llc = bandwidth.last_level_cache_bytes()

    assert llc > 0
    assert bandwidth.probe_bytes() >= min(4 * llc, bandwidth.MAX_PROBE_BYTES)
