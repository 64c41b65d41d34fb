"""The paged KV cache's blocks: which physical blocks each request holds, and which full
blocks hold a known prefix (automatic prefix caching).

Pure bookkeeping (no torch): the model runner owns the tensors, this module owns the ids.

A full block is named by a hash chained over its parent block's hash and its token ids
(`hash_block`), so that two requests whose prompts share the first k full blocks share
those k blocks' KV. The hash function is fixed (SHA-256), so the same prefix maps to the
same name in every process and run.

Invariants (tests/sched audits them after every step of random workloads):
- every block is free (reference count 0, in the free queue) or held by as many requests
  as its reference count, each holding it once;
- a block with a hash holds the KV of exactly the tokens that hash names, and the index
  maps that hash to that block; a free block keeps its hash (and its KV) until allocation
  takes it, least recently freed first, and drops the hash.
- a held block is never written again once it has a hash: requests share only full
  blocks, and a request writes only past its matched prefix.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from otel_engine.sched.request import Request

BlockHash = bytes

# Versioned, so that a change to what a hash covers never matches an old name.
_ROOT = b"otel-engine/prefix-cache/v1"


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def root_hash(cache_key: bytes = b"") -> BlockHash:
    """The parent of a request's first block. `cache_key` is whatever else changes the KV
    for the same tokens (none today; a LoRA adapter's id would go here)."""
    return hashlib.sha256(_ROOT + cache_key).digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The name of a full block: its parent's name and its token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend `request.block_hashes` to every full block of its tokens so far."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        parent = hashes[-1] if hashes else root_hash(request.cache_key)
        for index in range(len(hashes), num_full):
            start = index * block_size
            parent = hash_block(parent, request.token_ids(start, start + block_size))
            hashes.append(parent)
    return hashes


class BlockAllocator:
    """Fixed-size KV blocks handed to requests in whole blocks, shared when their full
    blocks hold the same prefix (when `enable_prefix_caching`)."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks, least recently freed first (an ordered dict: O(1) removal of a free
        # block that a request matches).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> the block that holds those tokens
        self._num_cached_free = 0
        # Prompt tokens looked up in / found in the cache, since the last `take_stats()`.
        self._queries = 0
        self._hits = 0
        self.total_queries = 0
        self.total_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can be given (cached free blocks included: they are evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable until evicted)."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (cached free blocks are not in use)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def hit_rate(self) -> float | None:
        """Prompt tokens found in the cache over prompt tokens looked up, since start."""
        return self.total_hits / self.total_queries if self.total_queries else None

    def match_prefix(self, request: Request) -> list[int]:
        """The cached blocks that hold the longest run of `request`'s first full blocks,
        leaving at least its last token to compute (so the request samples). Takes no
        reference: pass them to `can_allocate`/`allocate`."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hashes = update_block_hashes(request, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        matched = []
        for block_hash in hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            matched.append(block)
        return matched

    def record_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count one request's prompt lookup (once per request, on its first admission)."""
        if self.enable_prefix_caching:
            self._queries += num_prompt_tokens
            self._hits += num_cached_tokens
            self.total_queries += num_prompt_tokens
            self.total_hits += num_cached_tokens

    def take_stats(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens since the last call."""
        stats = self._queries, self._hits
        self._queries = self._hits = 0
        return stats

    def num_missing_blocks(self, request: Request, num_tokens: int) -> int:
        """How many more blocks `request` needs to hold `num_tokens` tokens."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int, matched: Sequence[int] = ()) -> bool:
        """Whether `allocate(request, num_tokens, matched)` would succeed."""
        missing = self.num_missing_blocks(request, num_tokens) - len(matched)
        taken_from_free = sum(1 for b in matched if self._ref_counts[b] == 0)
        return missing + taken_from_free <= len(self._free)

    def allocate(self, request: Request, num_tokens: int, matched: Sequence[int] = ()) -> None:
        """Grow `request.block_ids` so it can hold `num_tokens` tokens: first the `matched`
        cached blocks (shared: one more reference each), then fresh blocks."""
        if not self.can_allocate(request, num_tokens, matched):
            raise RuntimeError("allocate() without can_allocate(): out of KV blocks")
        refs = self._ref_counts
        for block in matched:
            if refs[block] == 0:
                del self._free[block]
                self._num_cached_free -= 1
            refs[block] += 1
        request.block_ids.extend(matched)
        missing = self.num_missing_blocks(request, num_tokens)
        for _ in range(missing):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            refs[block] = 1
            request.block_ids.append(block)

    def _evict(self, block: int) -> None:
        """Forget what a free block held: it is about to be written with other tokens."""
        block_hash = self._hashes[block]
        if block_hash is not None:
            self._num_cached_free -= 1
            self._hashes[block] = None
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]

    def cache_full_blocks(self, request: Request) -> None:
        """Name the blocks that `request`'s computed tokens have filled, so that later
        requests can share them (call after its `num_computed_tokens` grows)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_hashed_blocks:
            return
        hashes = update_block_hashes(request, self.block_size)
        for index in range(request.num_hashed_blocks, num_full):
            block, block_hash = request.block_ids[index], hashes[index]
            if self._hashes[block] is None and block_hash not in self._cached:
                self._hashes[block] = block_hash
                self._cached[block_hash] = block
        request.num_hashed_blocks = num_full

    def free(self, request: Request) -> None:
        """Drop `request`'s reference on each of its blocks. A block nobody holds becomes
        free, keeping its cached prefix; the request's last blocks are queued first, so
        that eviction takes a prefix's tail before its head."""
        refs = self._ref_counts
        for block in reversed(request.block_ids):
            refs[block] -= 1
            if refs[block] == 0:
                self._free[block] = None
                if self._hashes[block] is not None:
                    self._num_cached_free += 1
        request.block_ids.clear()
        request.num_hashed_blocks = 0

    # ---- for tests and audits ------------------------------------------------------------

    def audit(self, holders: Sequence[Request]) -> None:
        """Assert the invariants against the requests that hold blocks (tests call this)."""
        counts = [0] * self.num_blocks
        for request in holders:
            assert len(request.block_ids) == len(set(request.block_ids)), "held twice"
            for block in request.block_ids:
                counts[block] += 1
        assert counts == self._ref_counts, "a reference count disagrees with the holders"
        free = [b for b in range(self.num_blocks) if counts[b] == 0]
        assert sorted(self._free) == free, "a block is both free and held, or leaked"
        for block_hash, block in self._cached.items():
            assert self._hashes[block] == block_hash, "the index names the wrong block"
        named = [b for b, h in enumerate(self._hashes) if h is not None]
        assert len(named) == len(self._cached), "a named block is not in the index"
        assert self._num_cached_free == sum(1 for b in named if counts[b] == 0)
