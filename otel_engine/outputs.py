"""What `LLM.generate` returns and `AsyncLLM.generate` yields."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import msgspec

T = TypeVar("T")


class FinishReason(enum.StrEnum):
    """Why a completion ended: `CompletionOutput.finish_reason`, the OpenAI `finish_reason`
    and the `finish_reason` label of `otel_engine_request_success` carry the value."""

    STOP = "stop"  # a stop string or stop token, end of sequence, or a complete grammar
    LENGTH = "length"  # max_tokens
    TOOL_CALLS = "tool_calls"  # stopped after tool calls (the HTTP edge tells, from the text)
    ABORT = "abort"  # aborted: by its client, a stop string, or the engine refusing it


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's log-probability (float32 log-softmax of the raw logits, before
    penalties, temperature and truncation), and the `k` most likely tokens of its position."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class GrowingPrefix(Sequence[T]):
    """The first `len(self)` items of a list that only ever grows: an output's token ids or
    logprobs, which stay as they were when it was handed out while the request goes on (O(1)
    to make, unlike a copy per step). Compares equal to a list or tuple with the same items."""

    __slots__ = ("_ids", "_len")

    def __init__(self, ids: list[T], length: int | None = None) -> None:
        self._ids = ids
        self._len = len(ids) if length is None else length

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._ids[: self._len][index]
        if not -self._len <= index < self._len:
            raise IndexError("token index out of range")
        return self._ids[index % self._len]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._ids, self._len)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (GrowingPrefix, list, tuple)):
            return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(list(self))

    def __add__(self, other: Any) -> list[T]:
        return [*self, *other]


TokenIds = GrowingPrefix[int]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request. `text` and `token_ids` are cumulative;
    `delta_text` / `delta_token_ids` are what this output added (for streaming)."""

    index: int = 0
    text: str = ""
    token_ids: Sequence[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # With `SamplingParams.logprobs`: one entry per token of `token_ids` / `delta_token_ids`.
    logprobs: Sequence[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # With `SamplingParams.prompt_logprobs`: one entry per prompt token from the second on.
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
