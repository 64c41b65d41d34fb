"""The block allocator: whole blocks per request, every block free or owned exactly once."""

from __future__ import annotations

import pytest

from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.kv_cache import BlockAllocator, num_blocks_for
from otel_engine.sched.request import Request


def make_request(request_id: str = "r0", num_prompt: int = 3) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams())


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
