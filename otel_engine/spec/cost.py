"""What a step costs by how many decode sequences it runs, learned from the engine's own
steps, and how many proposals each request should verify given that cost.

A decode step reads every weight once whatever its batch, so on a small batch extra
sequences (a request's proposed tokens are sequences of their own: engine/batch.py) cost
almost nothing; past some batch the step's arithmetic is the limit and each one costs its
share. Where that knee is depends on the model, its formats and the machine (on a 2-core
EPYC, SmolLM2-135M in Q4_1: flat to about 5 sequences, then about 11% of a one-sequence
step per sequence: bench/spec_verify.py), so it is measured, not assumed: `StepCost` keeps
a moving average of the seconds of decode-only steps by their number of sequences.

`plan` then gives out proposals one at a time, always the one with the largest expected
gain next: the j-th proposal of a request whose proposals are each accepted with
probability p yields p^j tokens more (all before it must be accepted too), and costs the
step one sequence (and with a draft model maybe one more draft forward). Of all the
allocations on that path it keeps the one with the most expected tokens per second, if
that beats no proposals by MIN_IMPROVEMENT. So a
request whose proposals fail gets none, a small batch verifies many, and a batch past the
knee verifies only the proposals likely enough to pay for themselves (at 32 streams with
that model: about none).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import NamedTuple

EMA_WEIGHT = 0.2  # of the newest step, in a sequence count's moving average
# A count's first step stands only until its second replaces it: a new shape's first run
# pays one-time costs (the default model's first 16-sequence step took 26.9 ms, the 15s 23.3).
# Its next 1 / EMA_WEIGHT steps are averaged alike, then the average moves.
SETTLED_STEPS = 2  # a count's steps measured before its cost is more than a first run's
# Past the largest sequence count seen: up to EXPLORE_ROWS more cost what it did (a guess
# that lets the plan try slightly larger steps, and so learn what they cost), each one past
# those this share of it more (a cautious guess, above the measured 11%).
EXPLORE_ROWS = 4
UNSEEN_ROW_SHARE = 0.15
MIN_GAIN = 0.01  # expected tokens below which a proposal is not worth planning
# How much better than no proposals at all a plan must expect to be: the estimates are
# estimates (a request's next proposal is not its last ones; a step size's cost is an
# average), and a plan that only breaks even is a loss on a bad guess.
MIN_IMPROVEMENT = 0.05


class StepCost:
    """Seconds of a decode-only step by its number of sequences (moving averages), and of
    a forward that prefills, by its tokens (`prefill_token_seconds`)."""

    __slots__ = ("counts", "prefill_token_seconds", "rows", "seconds")

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.counts: dict[int, int] = {}  # steps measured, by sequence count
        self.rows: list[int] = []  # the measured counts, sorted
        self.prefill_token_seconds: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        old = self.seconds.get(rows)
        count = self.counts[rows] = self.counts.get(rows, 0) + 1
        if old is None:
            bisect.insort(self.rows, rows)
            self.seconds[rows] = seconds
        elif count == SETTLED_STEPS:
            self.seconds[rows] = seconds
        else:
            share = max(EMA_WEIGHT, 1 / (count - SETTLED_STEPS + 1))
            self.seconds[rows] = old + share * (seconds - old)

    def restart(self, rows: int, seconds: float) -> None:
        """A step of `rows` sequences took `seconds` where what was measured before no
        longer holds (other contexts): it stands as a first run does, until the next."""
        if rows <= 0 or seconds <= 0:
            return
        if rows not in self.seconds:
            bisect.insort(self.rows, rows)
        self.seconds[rows], self.counts[rows] = seconds, 1

    def is_settled(self, rows: int) -> bool:
        """Whether steps of `rows` sequences were measured past their first run."""
        return self.counts.get(rows, 0) >= SETTLED_STEPS

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward of `tokens` tokens that prefilled took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        per_token, old = seconds / tokens, self.prefill_token_seconds
        self.prefill_token_seconds = (
            per_token if old is None else old + EMA_WEIGHT * (per_token - old)
        )

    def predict(self, rows: int) -> float | None:
        """The expected seconds of a step of `rows` sequences: measured, else between the
        nearest measured sizes, else past the largest (EXPLORE_ROWS as it, then
        UNSEEN_ROW_SHARE more per sequence), else the smallest above; None before any step
        was measured."""
        seconds = self.seconds
        found = seconds.get(rows)
        if found is not None:
            return found
        index = bisect.bisect_left(self.rows, rows)
        below = self.rows[index - 1] if index > 0 else None
        above = self.rows[index] if index < len(self.rows) else None
        if below is None:
            return None if above is None else seconds[above]
        if above is None:
            return seconds[below] * (1 + UNSEEN_ROW_SHARE * max(0, rows - below - EXPLORE_ROWS))
        share = (rows - below) / (above - below)
        return seconds[below] + share * (seconds[above] - seconds[below])


class Plan(NamedTuple):
    """Proposals per request, and the expected tokens per second they give over none's (1.0
    for none; None before any step was measured)."""

    counts: list[int]
    gain: float | None


def plan(
    acceptance: Sequence[float],
    caps: Sequence[int],
    target: StepCost,
    draft: StepCost | None = None,
    catch_up: Sequence[int] = (),
    upfront: Sequence[float] = (),
) -> Plan:
    """How many proposals each decoding request verifies: `acceptance[i]` is request i's
    chance that a proposal is accepted, `caps[i]` the most it may verify; `target` the
    step's cost by its sequences; `draft` the draft model's forward by its sequences (a
    request's j-th proposal needs the j-th draft forward, which runs for every request
    with j or more; its first also runs the `catch_up[i]` tokens the draft has not seen,
    one sequence each, and `upfront[i]` seconds more: the share of a prefill the draft must
    run for it). Before the step's cost is known at all, every request takes its cap (the
    steps then measure it)."""
    n = len(caps)
    counts = [0] * n
    base = target.predict(n)
    if base is None:
        return Plan(list(caps), None)
    round_rows: list[int] = []  # sequences of each draft forward
    draft_seconds = 0.0
    tokens = float(n)
    plain_rate = tokens / base
    best_rate, best = plain_rate * (1 + MIN_IMPROVEMENT), list(counts)
    heap = [(-p, i) for i, p in enumerate(acceptance) if caps[i] > 0 and p >= MIN_GAIN]
    heapq.heapify(heap)
    added = 0
    while heap:
        negative, i = heapq.heappop(heap)
        gain = -negative
        counts[i] += 1
        added += 1
        tokens += gain
        if draft is not None:
            rows = catch_up[i] if counts[i] == 1 and catch_up else 1
            draft_seconds += _draft_round_delta(draft, round_rows, counts[i], rows)
            if counts[i] == 1 and upfront:
                draft_seconds += upfront[i]
        seconds = target.predict(n + added)
        assert seconds is not None
        rate = tokens / (seconds + draft_seconds)
        if rate > best_rate:
            best_rate, best = rate, list(counts)
        if counts[i] < caps[i] and gain * acceptance[i] >= MIN_GAIN:
            heapq.heappush(heap, (-gain * acceptance[i], i))
    return Plan(best, best_rate / plain_rate if any(best) else 1.0)


def _draft_round_delta(
    draft: StepCost, round_rows: list[int], round_index: int, added: int
) -> float:
    """`added` more sequences in draft forward `round_index` (1-based): what they add."""
    if len(round_rows) < round_index:
        round_rows.append(0)
    rows = round_rows[round_index - 1]
    round_rows[round_index - 1] = rows + added
    after = draft.predict(rows + added) or 0.0
    return after - (draft.predict(rows) or 0.0) if rows else after
