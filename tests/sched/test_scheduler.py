"""The continuous-batching scheduler: chunked prefill, decode-first batches, aborts,
preemption by recompute, and its bookkeeping invariants under long random workloads.

Pure Python: the model is replaced by sampled token ids drawn from a seeded generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.kv_cache import BlockAllocator, hash_block, root_hash
from otel_engine.sched.request import Request, RequestStatus
from otel_engine.sched.scheduler import Scheduler, SchedulerOutput

EOS = 0
STOP_TOKEN = 1


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 16,
    max_model_len: int | None = None,
    prefix_caching: bool = True,
) -> Scheduler:
    return Scheduler(
        BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len or num_blocks * block_size,
    )


def make_request(request_id: str, num_prompt: int, max_tokens: int = 8, **params: Any) -> Request:
    return Request(
        request_id,
        [100 + i for i in range(num_prompt)],
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
    )


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One schedule/update round in which every sampled token is `token`."""
    output = scheduler.schedule()
    sampled = [token for chunk in output.chunks if chunk.needs_sample]
    return output, scheduler.update(output, sampled)


# ---- behaviours --------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks() -> None:
    """A 40-token prompt with a 16-token budget runs as 16 + 16 + 8, sampling only at the end."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = make_request("long", 40)
    scheduler.add(request)

    chunks = []
    for _ in range(3):
        output, updated = run_step(scheduler)
        assert 1 == len(output.chunks)
        chunks.append((output.chunks[0].start, output.chunks[0].num_tokens, bool(updated)))

    assert [(0, 16, False), (16, 16, False), (32, 8, True)] == chunks
    assert 1 == request.num_output_tokens
    assert 40 == request.num_prompt_tokens


def test_prefill_chunk_needs_sample_only_when_it_reaches_the_end() -> None:
    """Only the chunk that completes the sequence asks for a token."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add(make_request("r", 12))

    first = scheduler.schedule()
    scheduler.update(first, [])
    second = scheduler.schedule()

    assert not first.chunks[0].needs_sample
    assert second.chunks[0].needs_sample


def test_decode_chunks_come_before_prefill_chunks() -> None:
    """A batch with a running decode and a new prompt lists the decode first."""
    scheduler = make_scheduler(max_num_batched_tokens=32, prefix_caching=False)
    scheduler.add(make_request("first", 6))
    run_step(scheduler)
    scheduler.add(make_request("second", 10))

    output = scheduler.schedule()

    assert [("first", 1), ("second", 10)] == [
        (c.request.request_id, c.num_tokens) for c in output.chunks
    ]


def test_running_requests_are_served_before_waiting_ones() -> None:
    """The budget goes to the running prefill first; the newcomer gets what is left."""
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add(make_request("first", 25))
    run_step(scheduler)
    scheduler.add(make_request("second", 25))

    output = scheduler.schedule()

    assert [("first", 10, 10)] == [
        (c.request.request_id, c.start, c.num_tokens) for c in output.chunks
    ]


def test_budget_is_shared_across_waiting_requests() -> None:
    """Three short prompts fit one step; a fourth is cut to the remaining budget."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    for index in range(4):
        scheduler.add(make_request(f"r{index}", 5))

    output = scheduler.schedule()

    assert {"r0": 5, "r1": 5, "r2": 5, "r3": 1} == {
        c.request.request_id: c.num_tokens for c in output.chunks
    }
    assert 16 == output.num_batched_tokens


def test_max_num_seqs_limits_running_requests() -> None:
    """With max_num_seqs=2 the third request waits even though budget and cache allow it."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for index in range(3):
        scheduler.add(make_request(f"r{index}", 4))

    run_step(scheduler)

    assert 2 == scheduler.num_running
    assert 1 == scheduler.num_waiting


def test_request_waits_when_cache_is_full() -> None:
    """A prompt whose first chunk needs more blocks than are free stays queued."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    scheduler.add(make_request("big", 12))
    scheduler.add(make_request("next", 8))

    output = scheduler.schedule()

    assert ["big"] == [c.request.request_id for c in output.chunks]
    assert ["next"] == [r.request_id for r in scheduler.waiting]


def test_finishing_by_max_tokens_frees_blocks() -> None:
    """After max_tokens samples the request is finished by length and owns no block."""
    scheduler = make_scheduler()
    request = make_request("r", 5, max_tokens=3)
    scheduler.add(request)

    for _ in range(3):
        run_step(scheduler)

    assert RequestStatus.FINISHED_LENGTH == request.status
    assert "length" == request.finish_reason
    assert [] == request.block_ids
    assert 16 == scheduler.allocator.num_free_blocks
    assert not scheduler.has_unfinished


def test_eos_finishes_unless_ignored() -> None:
    """EOS stops a request; with ignore_eos it keeps going."""
    scheduler = make_scheduler()
    stops = make_request("stops", 3)
    ignores = make_request("ignores", 3, ignore_eos=True)
    scheduler.add(stops)
    scheduler.add(ignores)

    run_step(scheduler, token=EOS)

    assert RequestStatus.FINISHED_STOPPED == stops.status
    assert stops.stop_reason is None
    assert RequestStatus.RUNNING == ignores.status


def test_stop_token_id_finishes_with_its_id() -> None:
    """A stop token id finishes the request and is reported as the stop reason."""
    scheduler = make_scheduler()
    request = make_request("r", 3, stop_token_ids=(STOP_TOKEN,))
    scheduler.add(request)

    run_step(scheduler, token=STOP_TOKEN)

    assert "stop" == request.finish_reason
    assert STOP_TOKEN == request.stop_reason


def test_max_model_len_finishes_by_length() -> None:
    """A sequence that reaches max_model_len ends even below max_tokens."""
    scheduler = make_scheduler(max_model_len=6)
    request = make_request("r", 4, max_tokens=10)
    scheduler.add(request)

    run_step(scheduler)
    run_step(scheduler)

    assert RequestStatus.FINISHED_LENGTH == request.status
    assert 6 == request.num_tokens


def test_abort_running_request_frees_blocks_at_once() -> None:
    """Aborting a running request returns its blocks before the next step."""
    scheduler = make_scheduler()
    request = make_request("r", 9)
    scheduler.add(request)
    run_step(scheduler)
    assert request.block_ids

    aborted = scheduler.abort(["r"])

    assert [request] == aborted
    assert RequestStatus.FINISHED_ABORTED == request.status
    assert [] == request.block_ids
    assert 16 == scheduler.allocator.num_free_blocks
    assert [] == scheduler.running
    assert not scheduler.has_unfinished


def test_abort_waiting_request_removes_it_from_the_queue() -> None:
    """A queued request can be aborted before it ever runs."""
    scheduler = make_scheduler()
    scheduler.add(make_request("r", 4))

    scheduler.abort(["r"])

    assert 0 == scheduler.num_waiting
    assert scheduler.schedule().is_empty


def test_abort_unknown_id_is_ignored() -> None:
    """Unknown and already finished ids are skipped without error."""
    scheduler = make_scheduler()
    scheduler.add(make_request("r", 4))

    assert [] == scheduler.abort(["nope"])
    assert 1 == scheduler.num_waiting


def test_abort_between_schedule_and_update_skips_its_sample() -> None:
    """A request aborted mid-step gets no token; the others still get theirs, in order."""
    scheduler = make_scheduler(max_num_batched_tokens=32)
    first, second = make_request("a", 4), make_request("b", 4)
    scheduler.add(first)
    scheduler.add(second)
    output = scheduler.schedule()

    scheduler.abort(["a"])
    updated = scheduler.update(output, [11, 22])

    assert [second] == updated
    assert [] == first.output_token_ids
    assert [22] == second.output_token_ids


def test_pause_frees_the_slot_and_blocks_for_a_waiting_request() -> None:
    """A paused request leaves the batch and gives its blocks back; the next step runs the
    request that was waiting for its slot."""
    scheduler = make_scheduler(max_num_seqs=1)
    first, second = make_request("a", 4), make_request("b", 4)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)

    scheduler.pause(["a"])
    output, _ = run_step(scheduler)

    assert (RequestStatus.PAUSED, [], 0) == (
        first.status,
        first.block_ids,
        first.num_computed_tokens,
    )
    assert ["b"] == [c.request.request_id for c in output.chunks]
    assert (1, 1, 0) == (scheduler.num_running, scheduler.num_paused, scheduler.num_waiting)


def test_resumed_request_recomputes_and_goes_on() -> None:
    """A resumed request is queued, prefilled again (prompt and outputs), and keeps its
    outputs (without the prefix cache: from position 0)."""
    scheduler = make_scheduler(prefix_caching=False)
    request = make_request("a", 4, max_tokens=8)
    scheduler.add(request)
    run_step(scheduler)
    run_step(scheduler)
    scheduler.pause(["a"])
    assert not scheduler.has_work

    scheduler.resume(["a"])
    output, updated = run_step(scheduler)

    assert [(0, 6)] == [(c.start, c.num_tokens) for c in output.chunks]
    assert [request] == updated
    assert 3 == request.num_output_tokens


def test_abort_paused_request_forgets_it() -> None:
    """Aborting a paused request finishes it; resuming it later is a no-op."""
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 4))
    run_step(scheduler)
    scheduler.pause(["a"])

    aborted = scheduler.abort(["a"])
    scheduler.resume(["a"])

    assert [RequestStatus.FINISHED_ABORTED] == [r.status for r in aborted]
    assert not scheduler.has_unfinished


def test_duplicate_request_id_is_rejected() -> None:
    """Two live requests cannot share an id."""
    scheduler = make_scheduler()
    scheduler.add(make_request("r", 4))

    with pytest.raises(ValueError, match="duplicate"):
        scheduler.add(make_request("r", 4))


def test_preemption_evicts_the_latest_running_request() -> None:
    """When a decode cannot grow, the last running request loses its blocks and goes back
    to the front of the queue with its progress reset; nothing new is admitted that step."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    first, second = make_request("first", 8), make_request("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # both prefilled: 2 blocks each, cache full
    scheduler.add(make_request("third", 1))

    output, _ = run_step(scheduler)

    assert ["second"] == output.preempted_request_ids
    assert ["first"] == [c.request.request_id for c in output.chunks]
    assert RequestStatus.PREEMPTED == second.status
    assert (0, [], 1) == (second.num_computed_tokens, second.block_ids, second.num_preemptions)
    assert ["second", "third"] == [r.request_id for r in scheduler.waiting]
    assert 1 == scheduler.num_preemptions


def test_preempted_request_recomputes_prompt_and_outputs() -> None:
    """On re-admission the request prefills prompt plus generated tokens, from position 0
    (without the prefix cache)."""
    scheduler = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, prefix_caching=False
    )
    first = make_request("first", 8, max_tokens=2)
    second = make_request("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    run_step(scheduler)  # second is preempted holding one output token; first finishes
    assert (1, "length") == (second.num_output_tokens, first.finish_reason)

    output, updated = run_step(scheduler)

    assert [(second, 0, 9)] == [(c.request, c.start, c.num_tokens) for c in output.chunks]
    assert [second] == updated
    assert 2 == second.num_output_tokens


def test_resumed_request_starts_after_its_cached_blocks() -> None:
    """With the prefix cache, a resumed request (4 prompt + 2 output tokens) takes back its
    full block and computes only the last two tokens."""
    scheduler = make_scheduler()
    request = make_request("a", 4, max_tokens=8)
    scheduler.add(request)
    run_step(scheduler)
    run_step(scheduler)
    scheduler.pause(["a"])

    scheduler.resume(["a"])
    output, updated = run_step(scheduler)

    assert [(4, 2)] == [(c.start, c.num_tokens) for c in output.chunks]
    assert [request] == updated
    assert 0 == request.num_cached_tokens, "counted on the first admission only"


def test_preempted_request_recomputes_only_what_the_cache_lost() -> None:
    """A preempted request's freed blocks stay cached until evicted, tail first: here the
    request that preempted it took its second block, so re-admitted it takes back its first
    block and computes the other five tokens (prompt and output)."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    first = make_request("first", 8, max_tokens=2)
    second = Request("second", [200 + i for i in range(8)], SamplingParams(max_tokens=8))
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    run_step(scheduler)  # second is preempted holding one output token; first finishes

    output, _ = run_step(scheduler)

    assert [(second, 4, 5)] == [(c.request, c.start, c.num_tokens) for c in output.chunks]


def test_request_sharing_a_prefix_starts_after_it() -> None:
    """A request whose first two blocks are cached is scheduled from token 8, counts 8
    cached prompt tokens, and the lookup is in the stats (prompt tokens queried, found)."""
    scheduler = make_scheduler(block_size=4)
    scheduler.add(make_request("first", 10))
    run_step(scheduler)
    scheduler.allocator.take_stats()
    second = make_request("second", 11)
    scheduler.add(second)

    output, _ = run_step(scheduler)

    assert [(second, 8, 3)] == [(c.request, c.start, c.num_tokens) for c in output.chunks[1:]]
    assert 8 == second.num_cached_tokens
    assert (11, 8) == scheduler.allocator.take_stats()


def test_request_that_cannot_grow_may_preempt_itself() -> None:
    """When the latest running request is the one that needs a block, it is the victim:
    the requests before it keep their chunks."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    first, second = make_request("first", 7), make_request("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # first holds 8 slots for 8 tokens, second needs a third block

    output = scheduler.schedule()

    assert ["second"] == output.preempted_request_ids
    assert [(first, 7, 1)] == [(c.request, c.start, c.num_tokens) for c in output.chunks]
    assert [first] == scheduler.running


# ---- invariants under random workloads ---------------------------------------------------


@dataclass
class Workload:
    """Knobs of one randomized run."""

    seed: int
    num_blocks: int = 24
    block_size: int = 4
    max_num_seqs: int = 6
    max_num_batched_tokens: int = 24
    num_steps: int = 1200
    add_probability: float = 0.35
    abort_probability: float = 0.05
    mid_step_abort_probability: float = 0.02
    pause_probability: float = 0.05
    resume_probability: float = 0.2
    prefix_caching: bool = True
    shared_prefix_probability: float = 0.6  # a prompt that starts with a common prefix
    resend_probability: float = 0.1  # a prompt that repeats an earlier one (a chat turn)


def check_invariants(scheduler: Scheduler) -> None:
    """No block leaked, double-freed or held without a reference; the prefix index names
    the blocks that hold it; queues and statuses agree with each other."""
    allocator = scheduler.allocator
    allocator.audit(list(scheduler.requests.values()))

    running_ids = [r.request_id for r in scheduler.running]
    waiting_ids = [r.request_id for r in scheduler.waiting]
    assert len(running_ids) == len(set(running_ids))
    assert len(waiting_ids) == len(set(waiting_ids))
    assert sorted(running_ids + waiting_ids + list(scheduler.paused)) == sorted(scheduler.requests)
    for request in scheduler.paused.values():
        assert RequestStatus.PAUSED == request.status
        assert (0, []) == (request.num_computed_tokens, request.block_ids)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for request in scheduler.running:
        assert RequestStatus.RUNNING == request.status
        assert 0 < request.num_computed_tokens < request.num_tokens + 1
        assert len(request.block_ids) * allocator.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert (0, []) == (request.num_computed_tokens, request.block_ids)


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """The batch respects the budgets, covers each request once, and lists decodes first."""
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(output.chunks) <= scheduler.max_num_seqs
    ids = [c.request.request_id for c in output.chunks]
    assert len(ids) == len(set(ids))
    sizes = [c.num_tokens for c in output.chunks]
    assert sizes == sorted(sizes, key=lambda n: n > 1)
    block_size = scheduler.allocator.block_size
    for chunk in output.chunks:
        request = chunk.request
        assert RequestStatus.RUNNING == request.status
        assert request.num_computed_tokens == chunk.start
        assert 0 < chunk.num_tokens
        assert chunk.start + chunk.num_tokens <= request.num_tokens
        assert len(request.block_ids) * block_size >= chunk.start + chunk.num_tokens
    for request_id in output.preempted_request_ids:
        assert request_id not in ids


class KvShadow:
    """What the KV cache would hold: each slot remembers the whole prefix whose last token
    was written there (the KV of a token depends on every token before it). Written as the
    model would write it, and checked against what each request attends to."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.allocator.block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, output: SchedulerOutput) -> None:
        """The step's chunks write their tokens; never into a block that is shared or that
        the prefix index names (its content must not change while someone may match it)."""
        allocator = self.scheduler.allocator
        for chunk in output.chunks:
            request = chunk.request
            tokens = request.token_ids(0, chunk.start + chunk.num_tokens)
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                block = request.block_ids[pos // self.block_size]
                assert 1 == allocator._ref_counts[block], "written while shared"
                assert allocator._hashes[block] is None, "a named block written again"
                self.slots[block, pos % self.block_size] = tuple(tokens[: pos + 1])

    def check(self) -> None:
        """Every running request's computed tokens are its own prefix's KV, and every named
        block holds the tokens its name says."""
        for request in self.scheduler.running:
            tokens = tuple(request.token_ids(0, request.num_computed_tokens))
            for pos in range(request.num_computed_tokens):
                block = request.block_ids[pos // self.block_size]
                assert tokens[: pos + 1] == self.slots[block, pos % self.block_size]
        allocator = self.scheduler.allocator
        for block_hash, block in allocator._cached.items():
            prefix = self.slots[block, self.block_size - 1]
            assert len(prefix) % self.block_size == 0
            parent = root_hash()
            for start in range(0, len(prefix), self.block_size):
                parent = hash_block(parent, prefix[start : start + self.block_size])
            assert block_hash == parent, "a name maps to a block holding other tokens"


SHARED_PREFIXES = [list(range(600 + 40 * i, 637 + 40 * i)) for i in range(3)]


def new_request(
    rng: random.Random,
    request_id: str,
    max_len: int,
    work: Workload | None = None,
    earlier: list[Request] | None = None,
) -> Request:
    num_prompt = rng.randint(1, max(1, max_len // 2))
    prompt = [rng.randrange(2, 500) for _ in range(num_prompt)]
    if work is not None and earlier and rng.random() < work.resend_probability:
        prompt = list(rng.choice(earlier[-20:]).prompt_token_ids)
    elif work is not None and rng.random() < work.shared_prefix_probability:
        prefix = rng.choice(SHARED_PREFIXES)
        prompt = (prefix[: rng.randint(1, len(prefix))] + prompt)[:num_prompt]
    max_tokens = rng.randint(1, max(1, min(24, max_len - len(prompt))))
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=(STOP_TOKEN,) if rng.random() < 0.3 else (),
    )
    return Request(request_id, prompt, params, eos_token_ids=frozenset({EOS}))


def sample_tokens(rng: random.Random, count: int) -> list[int]:
    return [
        rng.choice((EOS, STOP_TOKEN)) if rng.random() < 0.04 else rng.randrange(2, 500)
        for _ in range(count)
    ]


def is_sharing(scheduler: Scheduler, request: Request) -> bool:
    return any(scheduler.allocator._ref_counts[b] > 1 for b in request.block_ids)


def client_actions(
    rng: random.Random,
    work: Workload,
    scheduler: Scheduler,
    everyone: dict[str, Request],
    stats: dict[str, int],
) -> None:
    """Between two steps: a new request, an abort (of a running one half the time), a
    pause, a resume, each with its probability."""
    max_len = work.num_blocks * work.block_size
    if rng.random() < work.add_probability:
        request = new_request(rng, f"r{len(everyone)}", max_len, work, list(everyone.values()))
        everyone[request.request_id] = request
        scheduler.add(request)
    if scheduler.requests and rng.random() < work.abort_probability:
        if scheduler.running and rng.random() < 0.5:
            victim = rng.choice(scheduler.running)
        else:
            victim = scheduler.requests[rng.choice(sorted(scheduler.requests))]
        stats["shared_aborted"] += is_sharing(scheduler, victim)
        stats["aborts"] += len(scheduler.abort([victim.request_id]))
    if scheduler.requests and rng.random() < work.pause_probability:
        scheduler.pause([rng.choice(sorted(scheduler.requests))])
        stats["pauses"] += 1


def run_workload(work: Workload) -> dict[str, int]:
    """Random adds, aborts (between steps and mid-step), schedules and updates; then drain."""
    rng = random.Random(work.seed)
    max_len = work.num_blocks * work.block_size
    scheduler = make_scheduler(
        work.num_blocks,
        work.block_size,
        work.max_num_seqs,
        work.max_num_batched_tokens,
        max_len,
        prefix_caching=work.prefix_caching,
    )
    shadow = KvShadow(scheduler)
    allocator = scheduler.allocator
    everyone: dict[str, Request] = {}
    stats = {"steps": 0, "aborts": 0, "preemptions": 0, "chunked": 0, "pauses": 0}
    stats.update(shared_preempted=0, shared_aborted=0, evictions=0)
    step = 0
    while step < work.num_steps or scheduler.has_unfinished:
        step += 1
        assert step < work.num_steps + 20_000, "the scheduler stopped making progress"
        if step < work.num_steps:
            client_actions(rng, work, scheduler, everyone, stats)
        if scheduler.paused and (step >= work.num_steps or rng.random() < work.resume_probability):
            scheduler.resume([rng.choice(sorted(scheduler.paused))])
        check_invariants(scheduler)
        sharing = {r.request_id for r in scheduler.running if is_sharing(scheduler, r)}
        named = set(allocator._cached)
        output = scheduler.schedule()
        check_output(scheduler, output)
        shadow.write(output)
        stats["evictions"] += len(named - set(allocator._cached))
        stats["shared_preempted"] += len(sharing & set(output.preempted_request_ids))
        stats["preemptions"] += len(output.preempted_request_ids)
        stats["chunked"] += sum(1 for c in output.chunks if c.num_tokens > 1 and c.start > 0)
        if output.chunks and rng.random() < work.mid_step_abort_probability:
            stats["shared_aborted"] += is_sharing(scheduler, output.chunks[-1].request)
            stats["aborts"] += len(scheduler.abort([output.chunks[-1].request.request_id]))
        num_samples = sum(1 for c in output.chunks if c.needs_sample)
        updated = scheduler.update(output, sample_tokens(rng, num_samples))
        for request in updated:
            assert request.num_output_tokens <= request.sampling_params.max_tokens
            assert request.num_tokens <= max_len
        check_invariants(scheduler)
        shadow.check()
        stats["steps"] += 1
    assert all(r.status.is_finished for r in everyone.values())
    assert all(r.block_ids == [] for r in everyone.values())
    assert work.num_blocks == scheduler.allocator.num_free_blocks
    stats["cache_hit_tokens"] = sum(r.num_cached_tokens or 0 for r in everyone.values())
    assert (0, 0, 0) == (scheduler.num_running, scheduler.num_waiting, scheduler.num_paused)
    stats["requests"] = len(everyone)
    return stats


@pytest.mark.parametrize(
    ("seed", "prefix_caching"), [(seed, True) for seed in range(6)] + [(0, False), (1, False)]
)
def test_random_workload_keeps_invariants(seed: int, prefix_caching: bool) -> None:
    """1,200+ random steps with a small cache, shared prefixes and resent prompts, pauses
    and resumes: no leak, no double free, no block written while shared or named, every
    request attends to its own prefix's KV, budgets held, every request ends finished or
    aborted and every block is free at the end. With the cache on, the run shares blocks,
    preempts and aborts requests that share, and evicts cached blocks."""
    stats = run_workload(Workload(seed=seed, prefix_caching=prefix_caching))

    assert stats["steps"] >= 1200
    assert stats["requests"] > 300
    assert stats["preemptions"] > 0
    assert stats["aborts"] > 0
    assert stats["chunked"] > 0
    assert stats["pauses"] > 0
    if prefix_caching:
        assert stats["cache_hit_tokens"] > 500
        assert stats["shared_preempted"] > 0
        assert stats["shared_aborted"] > 0
        assert stats["evictions"] > 100
    else:
        assert 0 == stats["cache_hit_tokens"] == stats["evictions"]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(2, 32),
    max_num_seqs=st.integers(1, 8),
    max_num_batched_tokens=st.integers(1, 48),
    prefix_caching=st.booleans(),
)
def test_random_configs_keep_invariants(
    seed: int,
    block_size: int,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prefix_caching: bool,
) -> None:
    """The same invariants hold for any cache size, block size and budget."""
    work = Workload(
        seed=seed,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_steps=150,
        prefix_caching=prefix_caching,
    )

    run_workload(work)
