"""Decode speed against the physical limit: the bytes a decode step read (weights and KV
cache, `model/step_reads.py`) over the step's wall time, and that as a ratio of the memory
read bandwidth measured at start (`model/bandwidth.py`).

Only steps of decodes alone count: a step with a prefill chunk is bound by its arithmetic,
not by its reads, and would say nothing about the limit. At TP > 1 the bytes and the peak are
rank 0's: its shard and the LM head, against what its threads alone read. The engine core
keeps one for the step span and the crash dump, the api_server one for `/metrics` and
`GET /v1/models`; both show `part()`: the decode-only steps of the last `WINDOW_S` of
their time together, not one step.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_engine.model.bandwidth import MemoryBandwidth

# What /metrics, the card and the dump show: the decode-only steps of about the last second
# of their own time, together (one step alone is as noisy as its machine).
WINDOW_S = 1.0


class DecodeBandwidth:
    """The measured peak and the recent decode-only steps' bandwidth (bytes a second)."""

    def __init__(self, peak: MemoryBandwidth | None) -> None:
        self.peak = peak
        self._steps: deque[tuple[float, float]] = deque()  # (bytes, seconds) per step
        self._bytes = self._seconds = 0.0

    def of_step(self, num_bytes_read: int, seconds: float, is_decode_only: bool) -> float:
        """A step's own decode bandwidth, kept among the recent ones; 0.0 for a step that is
        not decodes alone (or read nothing, or took no time)."""
        if not is_decode_only or num_bytes_read <= 0 or seconds <= 0:
            return 0.0
        self.observe(num_bytes_read / seconds, seconds)
        return num_bytes_read / seconds

    def observe(self, bytes_per_second: float, seconds: float) -> None:
        """A decode-only step of `seconds`, as the engine core reported it (0: none)."""
        if bytes_per_second <= 0 or seconds <= 0:
            return
        self._steps.append((bytes_per_second * seconds, seconds))
        self._bytes += bytes_per_second * seconds
        self._seconds += seconds
        while len(self._steps) > 1 and self._seconds - self._steps[0][1] >= WINDOW_S:
            old_bytes, old_seconds = self._steps.popleft()
            self._bytes -= old_bytes
            self._seconds -= old_seconds

    @property
    def recent(self) -> float | None:
        """Bytes over seconds of the last WINDOW_S of decode-only steps; None before one."""
        return self._bytes / self._seconds if self._steps else None

    def ratio(self, bytes_per_second: float | None) -> float | None:
        """`bytes_per_second` over the peak; None without either."""
        if not bytes_per_second or self.peak is None or self.peak.bytes_per_second <= 0:
            return None
        return bytes_per_second / self.peak.bytes_per_second

    def part(self) -> dict[str, Any]:
        """The peak (how it was had) and the recent decode-only steps, plain numbers."""
        peak, recent = self.peak, self.recent
        ratio = self.ratio(recent)
        return {
            "peak_bytes_per_second": None if peak is None else round(peak.bytes_per_second),
            "peak_num_threads": None if peak is None else peak.num_threads,
            "peak_is_cached": None if peak is None else peak.is_cached,
            "decode_bytes_per_second": None if recent is None else round(recent),
            "decode_ratio": None if ratio is None else round(ratio, 4),
        }
