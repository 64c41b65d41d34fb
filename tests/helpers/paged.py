"""A step's attention metadata over a paged KV cache, as the scheduler would hand it over."""

from __future__ import annotations

import random
from typing import Any


def step_metadata(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int, seed: object
) -> dict[str, Any]:
    """`build_metadata`'s arguments for sequences of `seq_lens` tokens whose last
    `query_lens` run in this step (decodes first), each on blocks drawn at random from
    `num_blocks` (so that they are scattered over the cache)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    positions, slots = [], []
    for query_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        for p in range(seq_len - query_len, seq_len):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    return {
        "positions": positions,
        "slot_mapping": slots,
        "num_decodes": sum(1 for n in query_lens if n == 1),
        "query_lens": query_lens,
        "seq_lens": seq_lens,
        "block_tables": tables,
        "block_size": block_size,
    }
