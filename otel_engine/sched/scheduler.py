"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: running requests first (a decode token each, or the next
chunk of a prefill), then waiting ones in arrival order. A request admitted from the queue
starts after the longest run of its full blocks that the prefix cache holds (kv_cache.py);
only the rest is computed. When the KV cache cannot grow a running request, the most
recently arrived running request is preempted: its blocks are freed and it goes back to the
front of the queue to be recomputed later (from the cache, as far as it still holds them).

With speculative decoding (`speculation`, spec/), a decoding request may be given KV slots
for proposed tokens too; the step verifies them and `update` keeps the accepted ones (the
K/V of rejected ones is simply overwritten later: it is past `num_computed_tokens`).

A request whose client stopped reading is paused the same way (blocks freed, recomputed
later), but waits outside the queue until it is resumed, so it holds no slot meanwhile.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from otel_engine.sched.kv_cache import BlockAllocator
from otel_engine.sched.request import Request, RequestStatus
from otel_engine.spec.verify import accepted_tokens


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request, computed this step: its own, then
    `draft_token_ids`, the proposed tokens the step verifies (at most `num_spec_slots`, the
    KV slots the scheduler allocated for them)."""

    request: Request
    start: int
    num_tokens: int
    num_spec_slots: int = 0
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def needs_sample(self) -> bool:
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def num_sample_rows(self) -> int:
        """Positions sampled: the next token's, and one after each proposed token."""
        return 1 + len(self.draft_token_ids) if self.needs_sample else 0


class SpeculationPolicy(Protocol):
    """How many proposed tokens a decoding request may verify (spec/speculator.py)."""

    def start_step(self, running: Sequence[Request], num_waiting: int = 0) -> None: ...

    def slots(self, request: Request, limit: int) -> int: ...

    def observe(self, request: Request, proposed: int, accepted: int) -> None: ...


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch. Decode chunks (one token) come before prefill chunks."""

    step_id: int
    chunks: list[ScheduledChunk]
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class CacheTooSmall(Exception):
    """`Scheduler.restore`: the KV cache cannot hold request `index` of the batch."""

    def __init__(self, index: int, num_tokens: int) -> None:
        super().__init__(f"request {index} needs {num_tokens} tokens of KV cache")
        self.index = index
        self.num_tokens = num_tokens


class Scheduler:
    """Decides which tokens of which requests run in each step."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculation: SpeculationPolicy | None = None,
    ) -> None:
        self.allocator = allocator
        self.speculation = speculation
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def has_work(self) -> bool:
        """Something to schedule (paused requests wait for their clients, not for steps)."""
        return bool(self.running or self.waiting)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests at once and free their blocks; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._unqueue(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request)
            aborted.append(request)
        return aborted

    def pause(self, request_ids: Iterable[str]) -> None:
        """Take the given requests out of the batch and free their blocks until `resume`."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status == RequestStatus.PAUSED:
                continue
            self._unqueue(request)
            self._drop_kv(request)
            request.status = RequestStatus.PAUSED
            self.paused[request_id] = request

    def resume(self, request_ids: Iterable[str]) -> None:
        """Queue paused requests again (at the back: they are recomputed when scheduled)."""
        for request_id in request_ids:
            request = self.paused.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.PREEMPTED
                self.waiting.append(request)

    def restore(
        self, batch: list[tuple[Request, int, int, list[int]]], step_id: int
    ) -> SchedulerOutput:
        """A step's batch put back as it was (`otel-engine replay` rebuilding a crash dump's
        batch): each `(request, start, num_tokens, draft_token_ids)` running with `start`
        tokens computed and blocks for `start + num_tokens`, the step counter at `step_id`.
        Raises `CacheTooSmall` (before changing anything for that request) when the cache
        cannot hold one."""
        chunks = []
        for index, (request, start, num_tokens, drafts) in enumerate(batch):
            if not self.allocator.can_allocate(request, start + num_tokens):
                raise CacheTooSmall(index, start + num_tokens)
            self.allocator.allocate(request, start + num_tokens)
            request.num_computed_tokens = start
            request.status = RequestStatus.RUNNING
            self.requests[request.request_id] = request
            self.running.append(request)
            chunks.append(ScheduledChunk(request, start, num_tokens, len(drafts), list(drafts)))
        self.num_steps = step_id
        return SchedulerOutput(step_id=step_id, chunks=chunks)

    def _unqueue(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.PAUSED:
            del self.paused[request.request_id]
        else:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        output = SchedulerOutput(step_id=self.num_steps, chunks=[])
        if self.speculation is not None:
            room = max(0, self.max_num_seqs - len(self.running))
            self.speculation.start_step(self.running, min(len(self.waiting), room))
        budget = self._schedule_running(output, self.max_num_batched_tokens)
        if not output.preempted_request_ids:
            self._schedule_waiting(output, budget)
        output.chunks.sort(key=lambda c: c.num_tokens > 1)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            end = request.num_computed_tokens + num_new
            slots = self._spec_slots(request, num_new, budget)
            if slots and not self.allocator.can_allocate(request, end + slots):
                slots = 0  # proposals never cost another request its blocks
            while not self.allocator.can_allocate(request, end):
                victim = self.running.pop()
                self._preempt(victim, output)
                if victim is request:
                    return budget
            self.allocator.allocate(request, end + slots)
            output.chunks.append(
                ScheduledChunk(request, request.num_computed_tokens, num_new, slots)
            )
            budget -= num_new + slots
            index += 1
        return budget

    def _spec_slots(self, request: Request, num_new: int, budget: int) -> int:
        """KV slots for proposed tokens of a decoding request: what the policy grants
        within the step's budget, the context and the request's max_tokens (the last
        accepted token must still fit: a step adds up to slots + 1 tokens)."""
        if self.speculation is None or num_new != 1 or not request.output_token_ids:
            return 0
        limit = min(
            budget - 1,
            self.max_model_len - request.num_tokens - 1,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
        )
        return self.speculation.slots(request, limit) if limit > 0 else 0

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            matched = self.allocator.match_prefix(request)
            num_cached = len(matched) * self.allocator.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            end = num_cached + num_new
            if not self.allocator.can_allocate(request, end, matched):
                break
            self.waiting.popleft()
            self.allocator.allocate(request, end, matched)
            request.num_computed_tokens, request.num_hashed_blocks = num_cached, len(matched)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
                request.num_cached_tokens = num_cached
                self.allocator.record_lookup(request.num_prompt_tokens, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new

    def _drop_kv(self, request: Request) -> None:
        """Free the request's blocks: its K/V (and its draft model's) is recomputed later."""
        self.allocator.free(request)
        request.num_computed_tokens = 0
        if request.spec is not None:
            request.spec.num_draft_computed = 0

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self._drop_kv(request)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        output.preempted_request_ids.append(request.request_id)

    def update(self, output: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Advance progress after a step. `sampled` has `num_sample_rows` tokens per chunk,
        in chunk order: one per chunk that `needs_sample`, one more per proposed token it
        verified. Returns the requests that got new tokens (`num_new_tokens` of them)."""
        updated = []
        position = 0
        for chunk in output.chunks:
            request = chunk.request
            rows = sampled[position : position + chunk.num_sample_rows]
            position += chunk.num_sample_rows
            if request.status != RequestStatus.RUNNING:
                continue
            drafts = chunk.draft_token_ids
            if not rows:
                request.num_computed_tokens += chunk.num_tokens
                self.allocator.cache_full_blocks(request)
                continue
            kept = accepted_tokens(rows, drafts)
            if drafts and self.speculation is not None:
                self.speculation.observe(request, len(drafts), len(kept) - 1)
            request.num_new_tokens = self._append(request, kept)
            # The K/V of its own tokens and of the proposals it kept (all but the last
            # token it gained, which the next step computes).
            own = chunk.num_tokens - len(drafts)
            request.num_computed_tokens += own + request.num_new_tokens - 1
            self.allocator.cache_full_blocks(request)
            if request.status.is_finished:
                self.running.remove(request)
                self._release(request)
            updated.append(request)
        return updated

    def _append(self, request: Request, token_ids: list[int]) -> int:
        """Append tokens until one finishes the request; how many were appended."""
        for count, token_id in enumerate(token_ids, 1):
            request.append_token(token_id)
            if not request.status.is_finished and request.num_tokens >= self.max_model_len:
                request.status = RequestStatus.FINISHED_LENGTH
            if request.status.is_finished:
                return count
        return len(token_ids)

    def _release(self, request: Request) -> None:
        self.allocator.free(request)
        del self.requests[request.request_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_paused(self) -> int:
        return len(self.paused)
