"""The engine core's flight recorder: the last N steps as plain numbers, for crash dumps.

A fixed ring of `StepRecord`s (no request ids, no token ids, nothing a client sent), one written per
step; the crash dump's `history` part lists them oldest first. What the steps before a crash
show: durations growing before a hang (and how much of each went to grammar masks), KV usage
and preemptions climbing before an OOM, the batch shape that preceded the failing one.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class StepRecord(NamedTuple):
    """One step as the crash dump's `history` lists it (a row of numbers, named by FIELDS)."""

    step_id: int
    started_at: float  # wall clock, seconds since the epoch
    duration_s: float
    num_requests: int
    num_prefill_chunks: int
    num_scheduled_tokens: int
    num_preemptions: int
    kv_cache_usage: float
    num_cached_blocks: int
    num_running: int
    num_waiting: int
    num_paused: int
    grammar_mask_s: float  # the step's structured-output masks: why a step with grammars is slow
    num_grammar_deferred: int  # structured requests that sat the step out (its mask budget)
    num_draft_tokens: int = 0  # proposed tokens it verified (speculative decoding)
    num_accepted_tokens: int = 0  # of them, accepted


FIELDS = StepRecord._fields


class StepHistory:
    """The last `size` steps (0: none kept)."""

    __slots__ = ("_next", "_ring", "size")

    def __init__(self, size: int) -> None:
        self.size = max(0, size)
        self._ring: list[StepRecord | None] = [None] * self.size
        self._next = 0

    def record(self, row: StepRecord) -> None:
        """One step."""
        if self.size:
            self._ring[self._next % self.size] = row
            self._next += 1

    def part(self) -> dict[str, Any]:
        """The crash dump's `history`: field names, and the kept steps oldest first."""
        start = self._next % self.size if self._next > self.size else 0
        rows = self._ring[start:] + self._ring[:start] if self.size else []
        steps = [[round(v, 6) if isinstance(v, float) else v for v in r] for r in rows if r]
        return {
            "fields": list(FIELDS),
            "steps": steps,
            "num_steps_recorded": self._next,
            "num_omitted_steps": self._next - len(steps),
        }
