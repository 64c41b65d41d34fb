"""Prompt lookup: the tokens that followed the most recent earlier occurrence of the
request's last n tokens, for the longest n in [n_min, n_max] that has one.

The request's tokens live in a growing numpy buffer (`TokenHistory`) that takes only the
tokens added since the last call, so a lookup costs a few vector compares over the history
(tens of µs for thousands of tokens), not a copy of it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class HasTokens(Protocol):
    """A request's tokens (sched/request.Request)."""

    @property
    def num_tokens(self) -> int: ...

    def token_ids(self, start: int, end: int) -> list[int]: ...


class TokenHistory:
    """Prompt and output ids of one request as an int32 array, appended to in place."""

    __slots__ = ("buffer", "length")

    def __init__(self) -> None:
        self.buffer = np.empty(256, dtype=np.int32)
        self.length = 0

    def sync(self, request: HasTokens) -> np.ndarray:
        """The request's tokens so far (a view; valid until the next call)."""
        total = request.num_tokens
        if total > self.length:
            if total > len(self.buffer):
                grown = np.empty(max(total, 2 * len(self.buffer)), dtype=np.int32)
                grown[: self.length] = self.buffer[: self.length]
                self.buffer = grown
            self.buffer[self.length : total] = request.token_ids(self.length, total)
            self.length = total
        return self.buffer[:total]


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier match of the last n tokens of
    `tokens`, trying n from `n_max` down to `n_min`; [] when none matches."""
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at i in [0, length - n): each is followed by at least one token.
        num_windows = length - n
        match = tokens[:num_windows] == tokens[length - n]
        for offset in range(1, n):
            if not match.any():
                break
            match &= tokens[offset : offset + num_windows] == tokens[length - n + offset]
        found = np.flatnonzero(match)
        if len(found):
            start = int(found[-1]) + n
            return tokens[start : start + k].tolist()
    return []
