"""The block allocator: whole blocks per request, each block free or held by as many
requests as its reference count; full blocks named by their prefix and shared."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

import pytest

from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.kv_cache import (
    BlockAllocator,
    hash_block,
    num_blocks_for,
    root_hash,
    update_block_hashes,
)
from otel_engine.sched.request import Request


def make_request(request_id: str = "r0", num_prompt: int = 3) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams())


def prompt_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def admit(allocator: BlockAllocator, request: Request) -> list[int]:
    """What the scheduler does on admission: match, take the matched blocks and the rest of
    the prompt, and (as if the step ran) name the full blocks. Returns the matched blocks."""
    matched = allocator.match_prefix(request)
    allocator.allocate(request, request.num_tokens, matched)
    request.num_hashed_blocks = len(matched)
    request.num_computed_tokens = request.num_tokens
    allocator.cache_full_blocks(request)
    return matched


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)]
)
def test_num_blocks_for_rounds_up(num_tokens: int, expected: int) -> None:
    """A partly filled block still counts as a whole block."""
    assert expected == num_blocks_for(num_tokens, 4)


def test_new_allocator_is_all_free() -> None:
    """Every block starts free and usage is zero."""
    allocator = BlockAllocator(num_blocks=10, block_size=4)

    assert 10 == allocator.num_free_blocks
    assert 0.0 == allocator.usage


def test_zero_blocks_is_rejected() -> None:
    """A cache without a single block cannot serve anything."""
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(num_blocks=0, block_size=4)


def test_can_allocate_at_the_boundary() -> None:
    """Three free blocks of 4 hold 12 tokens but not 13."""
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    request = make_request()

    assert allocator.can_allocate(request, 12)
    assert not allocator.can_allocate(request, 13)


def test_allocate_gives_whole_blocks() -> None:
    """Allocating 5 tokens of block size 4 takes two distinct blocks."""
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    request = make_request()

    allocator.allocate(request, 5)

    assert 2 == len(request.block_ids)
    assert 2 == len(set(request.block_ids))
    assert 6 == allocator.num_free_blocks
    assert 0.25 == allocator.usage


def test_allocate_grows_only_by_missing_blocks() -> None:
    """Growing from 5 to 9 tokens adds one block and keeps the first two."""
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    request = make_request()
    allocator.allocate(request, 5)
    first = list(request.block_ids)

    allocator.allocate(request, 9)

    assert first == request.block_ids[:2]
    assert 3 == len(request.block_ids)


def test_allocate_within_held_blocks_is_a_no_op() -> None:
    """A request that already holds enough blocks gets none more."""
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    request = make_request()
    allocator.allocate(request, 8)

    allocator.allocate(request, 6)

    assert 2 == len(request.block_ids)
    assert 6 == allocator.num_free_blocks
    assert 0 == allocator.num_missing_blocks(request, 8)
    assert 1 == allocator.num_missing_blocks(request, 9)


def test_can_allocate_counts_blocks_already_held() -> None:
    """Only the missing blocks have to be free."""
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    request = make_request()
    allocator.allocate(request, 8)

    assert allocator.can_allocate(request, 12)
    assert not allocator.can_allocate(request, 13)


def test_allocate_without_room_raises_and_changes_nothing() -> None:
    """Allocating past the free list is a bug in the caller, not a partial grant."""
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    request = make_request()

    with pytest.raises(RuntimeError, match="out of KV blocks"):
        allocator.allocate(request, 9)

    assert [] == request.block_ids
    assert 2 == allocator.num_free_blocks


def test_requests_get_disjoint_blocks() -> None:
    """Two requests never share a block."""
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    first, second = make_request("a"), make_request("b")

    allocator.allocate(first, 6)
    allocator.allocate(second, 6)

    assert set() == set(first.block_ids) & set(second.block_ids)
    assert 0 == allocator.num_free_blocks


def test_free_returns_every_block() -> None:
    """After free the request holds nothing and the cache is empty again."""
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    request = make_request()
    allocator.allocate(request, 16)

    allocator.free(request)

    assert [] == request.block_ids
    assert 4 == allocator.num_free_blocks
    assert 0.0 == allocator.usage


def test_freed_blocks_are_reused() -> None:
    """Blocks freed by one request can be given to the next."""
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    first, second = make_request("a"), make_request("b")
    allocator.allocate(first, 8)
    held = set(first.block_ids)
    allocator.free(first)

    allocator.allocate(second, 8)

    assert held == set(second.block_ids)


def test_free_twice_does_not_duplicate_blocks() -> None:
    """Freeing a request that holds nothing leaves the free list as it was."""
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    request = make_request()
    allocator.allocate(request, 8)
    allocator.free(request)

    allocator.free(request)

    assert 3 == allocator.num_free_blocks


# ---- prefix caching ----------------------------------------------------------------------


def test_block_hash_is_sha256_of_parent_and_token_ids() -> None:
    """The name of a block is a fixed function of its parent's name and its tokens."""
    parent = root_hash()
    expected = hashlib.sha256(parent + array("q", [5, 6, 7, 8]).tobytes()).digest()

    assert expected == hash_block(parent, [5, 6, 7, 8])
    assert hash_block(parent, [5, 6, 7, 8]) != hash_block(parent, [5, 6, 7, 9])
    assert hash_block(parent, [5, 6, 7, 8]) != hash_block(hash_block(parent, [1]), [5, 6, 7, 8])
    assert root_hash() != root_hash(b"adapter-1"), "a cache key changes every name after it"


def test_block_hashes_are_the_same_in_another_process() -> None:
    """Python's own hash() is salted per process; block names must not be."""
    code = (
        "from otel_engine.sched.kv_cache import hash_block, root_hash;"
        "print(hash_block(hash_block(root_hash(), [1, 2, 3]), [4, 5, 6]).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()

    assert hash_block(hash_block(root_hash(), [1, 2, 3]), [4, 5, 6]).hex() == other


def test_hashes_cover_full_blocks_only() -> None:
    """A request's names cover its full blocks, prompt and outputs alike, chained."""
    request = prompt_request("a", list(range(10)))

    hashes = update_block_hashes(request, 4)
    assert 2 == len(hashes)
    assert hash_block(hashes[0], [4, 5, 6, 7]) == hashes[1]
    request.output_token_ids.extend([10, 11])
    assert 3 == len(update_block_hashes(request, 4))


def test_second_request_shares_the_full_blocks_of_a_common_prefix() -> None:
    """Two blocks in common: the second request takes the first's blocks (one more
    reference each) and only computes the rest."""
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    first = prompt_request("a", [*range(100, 108), 1, 2, 3])
    admit(allocator, first)
    allocator.audit([first])

    second = prompt_request("b", [*range(100, 108), 9, 9])
    matched = allocator.match_prefix(second)
    allocator.allocate(second, second.num_tokens, matched)

    assert first.block_ids[:2] == matched == second.block_ids[:2]
    assert second.block_ids[2] not in first.block_ids
    allocator.audit([first, second])
    assert 4 / 16 == allocator.usage  # 3 + 1 distinct blocks held


def test_the_last_token_is_always_computed() -> None:
    """A prompt of exactly two cached blocks matches one: the request must sample."""
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    admit(allocator, prompt_request("a", list(range(8))))

    assert 1 == len(allocator.match_prefix(prompt_request("b", list(range(8)))))
    assert 2 == len(allocator.match_prefix(prompt_request("c", list(range(9)))))


def test_a_partial_block_or_a_different_block_ends_the_match() -> None:
    """Only full blocks are shared, and the match stops at the first block that differs
    (even if a later one is equal: its name depends on everything before it)."""
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    admit(allocator, prompt_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))

    assert 1 == len(allocator.match_prefix(prompt_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9])))
    assert 0 == len(allocator.match_prefix(prompt_request("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])))
    assert 2 == len(allocator.match_prefix(prompt_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 9])))


def test_freed_blocks_keep_their_prefix_until_evicted_least_recently_freed_first() -> None:
    """A finished request's blocks stay matchable while free; allocation evicts the
    least recently freed first, and among one request's blocks its tail first."""
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    old, recent = prompt_request("a", [1, 2, 3, 4, 5]), prompt_request("b", [7, 8, 9])
    admit(allocator, old)
    allocator.free(old)
    admit(allocator, recent)
    allocator.free(recent)
    assert 3 == allocator.num_cached_blocks  # [1,2] [3,4] [7,8]; partial blocks are unnamed
    assert 4 == allocator.num_free_blocks

    taker = make_request("c", num_prompt=4)  # two fresh blocks: evicts old's tail, then head
    allocator.allocate(taker, 4)
    allocator.audit([taker])

    assert [] == allocator.match_prefix(prompt_request("d", [1, 2, 3, 4, 5]))
    assert 1 == len(allocator.match_prefix(prompt_request("e", [7, 8, 9])))


def test_a_matched_free_block_is_taken_out_of_the_free_list() -> None:
    """Reusing a cached free block is not an allocation from the free list: it cannot be
    given to anybody else while held."""
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    first = prompt_request("a", [1, 2, 3])
    admit(allocator, first)
    allocator.free(first)

    second = prompt_request("b", [1, 2, 5, 6, 7])
    matched = allocator.match_prefix(second)
    assert allocator.can_allocate(second, 5, matched)
    allocator.allocate(second, 5, matched)

    assert matched == second.block_ids[:1]
    assert 0 == allocator.num_free_blocks
    assert not allocator.can_allocate(make_request("c", 1), 1)
    allocator.audit([second])


def test_freeing_one_sharer_keeps_the_blocks_of_the_other() -> None:
    """Abort or preemption of one sharer drops only its own references."""
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    first, second = prompt_request("a", [1, 2, 3, 4, 5]), prompt_request("b", [1, 2, 3, 4, 6])
    admit(allocator, first)
    admit(allocator, second)
    shared = first.block_ids[:2]

    allocator.free(first)

    assert shared == second.block_ids[:2]
    allocator.audit([second])
    big = make_request("c", num_prompt=2 * allocator.num_free_blocks)
    allocator.allocate(big, big.num_tokens)  # every free block: the shared ones are not free
    assert set() == set(big.block_ids) & set(shared)
    allocator.audit([second, big])


def test_can_allocate_counts_matched_free_blocks_as_taken() -> None:
    """Matched blocks that are free come out of the free list too."""
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    first = prompt_request("a", [1, 2, 3, 4, 5])
    admit(allocator, first)
    allocator.free(first)  # three free blocks, two of them named

    second = prompt_request("b", [1, 2, 3, 4, 9, 9, 9])  # two matched + two new: four
    matched = allocator.match_prefix(second)

    assert 2 == len(matched)
    assert not allocator.can_allocate(second, 7, matched)
    assert allocator.can_allocate(second, 6, matched)


def test_disabled_prefix_caching_never_matches_or_counts() -> None:
    """--no-enable-prefix-caching: the allocator of before (no names, no stats)."""
    allocator = BlockAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(allocator, prompt_request("a", [1, 2, 3, 4, 5]))
    allocator.record_lookup(5, 0)

    assert [] == allocator.match_prefix(prompt_request("b", [1, 2, 3, 4, 5]))
    assert (0, 0) == allocator.take_stats()
    assert allocator.hit_rate is None


def test_lookups_are_counted_in_tokens() -> None:
    """Stats are prompt tokens: queried and found, reset by take_stats, kept in total."""
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    allocator.record_lookup(10, 4)
    allocator.record_lookup(6, 0)

    assert (16, 4) == allocator.take_stats()
    assert (0, 0) == allocator.take_stats()
    assert 0.25 == allocator.hit_rate
