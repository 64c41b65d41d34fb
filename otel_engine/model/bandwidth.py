"""This machine's memory read bandwidth: the limit a decode step is held against.

A decode step reads every weight matrix of the model once and the KV cache of every sequence,
so it cannot run faster than those bytes take to come from memory. `peak_read_bandwidth`
measures how fast this process's torch threads read memory: a sum over a buffer of 2 MiB
pages well beyond the last-level cache (`probe_bytes`), best of `PROBE_PASSES` passes with
its threads and as many with one, about
0.2 s on this project's 2-core machine when idle (up to 2 s under load). The result is kept
as JSON in `$OTEL_ENGINE_CACHE_DIR/bandwidth/` (beside the kernel builds, `cache.py`),
named by what changes it (the CPU model, the thread count, `PROBE_VERSION`) and renamed into
place atomically, so later starts read the file instead of probing. torch is imported only
by the probe: the value type travels to processes that never import it (`Ready`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import msgspec

from otel_engine.cache import cache_root

logger = logging.getLogger(__name__)

PROBE_VERSION = 2  # raise when the probe measures differently: cached values are then stale
PROBE_PASSES = 5
MIN_PROBE_BYTES = 256 << 20
MAX_PROBE_BYTES = 1 << 30
CACHE_LLC_MULTIPLE = 8  # the buffer is at least this many last-level caches


class MemoryBandwidth(msgspec.Struct, frozen=True):
    """The peak read bandwidth rank 0's process measured with its `num_threads` threads
    (bytes a second), on `cpu`; `is_cached`: read from an earlier start's probe."""

    bytes_per_second: float
    num_threads: int
    cpu: str
    probe_bytes: int
    is_cached: bool = False


def peak_read_bandwidth() -> MemoryBandwidth | None:
    """The cached measurement for this CPU and thread count, else a new one (cached); None,
    logged, when the probe's buffer cannot be had."""
    import torch

    cpu, num_threads = cpu_model(), torch.get_num_threads()
    path = cache_path(cpu, num_threads)
    cached = _read(path, cpu, num_threads)
    if cached is not None:
        return cached
    started = time.monotonic()
    try:
        measured = measure(num_threads, cpu)
    except MemoryError as error:
        logger.warning("bandwidth.unavailable", extra={"reason": str(error)})
        return None
    logger.info(
        "bandwidth.measured",
        extra={
            "bytes_per_second": round(measured.bytes_per_second),
            "num_threads": num_threads,
            "probe_bytes": measured.probe_bytes,
            "seconds": round(time.monotonic() - started, 3),
            "path": str(path),
        },
    )
    _write(path, measured)
    return measured


def measure(num_threads: int, cpu: str) -> MemoryBandwidth:
    """The probe: the buffer written once (so every page is mapped to memory of its own),
    then summed as int64 `PROBE_PASSES` times with `num_threads` threads and as many with
    one; the fastest pass counts. A pass of several threads waits for the slowest, and on a
    busy machine (a 2-core VM with neighbours) one thread alone read 1.5-2x faster here."""
    import torch

    from otel_engine.memory import huge_page_region

    size = probe_bytes()
    region = huge_page_region(size, "the memory bandwidth probe's buffer")
    words = region.view(torch.int64)
    words.zero_()
    best = float("inf")
    try:
        for threads in dict.fromkeys((num_threads, 1)):
            torch.set_num_threads(threads)
            for _ in range(PROBE_PASSES):
                started = time.perf_counter()
                words.sum()
                best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(num_threads)
    del words, region  # the mapping goes back to the system before the model loads
    return MemoryBandwidth(size / best, num_threads, cpu, size)


def probe_bytes() -> int:
    """`MIN_PROBE_BYTES`, or `CACHE_LLC_MULTIPLE` last-level caches where that is more (at
    most `MAX_PROBE_BYTES`), in whole 2 MiB pages."""
    wanted = max(MIN_PROBE_BYTES, CACHE_LLC_MULTIPLE * last_level_cache_bytes())
    return min(wanted, MAX_PROBE_BYTES) >> 21 << 21


def last_level_cache_bytes() -> int:
    """The largest cache sysfs lists for CPU 0 (0 where it lists none)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(cpu: str, num_threads: int) -> Path:
    key = f"{PROBE_VERSION}\n{platform.machine()}\n{cpu}\n{num_threads}".encode()
    name = f"read-{num_threads}t-{hashlib.sha256(key).hexdigest()[:16]}.json"
    return Path(cache_root()) / "bandwidth" / name


def _read(path: Path, cpu: str, num_threads: int) -> MemoryBandwidth | None:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
        if (found["probe_version"], found["cpu"], found["num_threads"]) != (
            PROBE_VERSION,
            cpu,
            num_threads,
        ):
            return None
        return MemoryBandwidth(
            float(found["bytes_per_second"]), num_threads, cpu, int(found["probe_bytes"]), True
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, measured: MemoryBandwidth) -> None:
    """Renamed into place, so a reader sees a whole file or none; a cache directory that
    cannot be written only means the next start probes again."""
    record = {
        "probe_version": PROBE_VERSION,
        **msgspec.structs.asdict(measured),
        "is_cached": True,
    }
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".probe-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(record, out)
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("bandwidth.not_cached", extra={"path": str(path), "reason": str(error)})
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
