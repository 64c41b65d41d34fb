"""The paged KV cache's block allocator: which physical blocks each request owns.

Pure bookkeeping (no torch): the model runner owns the tensors, this module owns the ids.
Invariant: every block id is either free or owned by exactly one request.
"""

from __future__ import annotations

from collections import deque

from otel_engine.sched.request import Request


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockAllocator:
    """A free list of fixed-size KV blocks, handed to requests in whole blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_missing_blocks(self, request: Request, num_tokens: int) -> int:
        """How many more blocks `request` needs to hold `num_tokens` tokens."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.num_missing_blocks(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow `request.block_ids` so it can hold `num_tokens` tokens."""
        missing = self.num_missing_blocks(request, num_tokens)
        if missing > len(self._free):
            raise RuntimeError("allocate() without can_allocate(): out of KV blocks")
        request.block_ids.extend(self._free.popleft() for _ in range(missing))

    def free(self, request: Request) -> None:
        """Return every block of `request` to the free list."""
        self._free.extend(request.block_ids)
        request.block_ids.clear()
