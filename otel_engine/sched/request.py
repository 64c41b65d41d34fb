"""A request as the scheduler sees it: tokens, progress, KV blocks, and why it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from otel_engine.outputs import FinishReason
from otel_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from otel_engine.engine.grammars import RequestGrammar
    from otel_engine.spec.state import SpecState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    PAUSED = 3  # its client stopped reading; no blocks, not queued until resumed
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request inside the engine core.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the request needs a
    sample when a step brings it to `num_tokens`. Preemption frees the blocks and resets
    it to 0 (recompute: prompt and outputs are prefilled again).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.time)  # wall clock, set by the front end
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix caching (sched/kv_cache.py): the names of its full blocks so far, how many of
    # its blocks are named in the cache, and how many prompt tokens its first admission
    # found cached. `cache_key` is what else changes the KV for the same tokens (none yet).
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_cached_tokens: int | None = None
    cache_key: bytes = b""
    # With `prompt_logprobs`: the logprobs of prompt tokens 2..n, collected chunk by chunk.
    prompt_logprobs: list[Any] | None = None
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | None = None
    first_scheduled_time: float | None = None
    trace_link: Any = None  # an OpenTelemetry Link to the request's span, when tracing
    # With `structured_output`: its position in the grammar (engine/grammars.py).
    grammar: RequestGrammar | None = None
    # With speculative decoding: its proposals' counts and state (spec/state.py).
    spec: SpecState | None = None
    num_new_tokens: int = 0  # the tokens its last step gained (more than 1: proposals kept)

    # What a crash dump may show (observability/crash_dump.py): never token ids or text.
    # A field missing here is left out of dumps and listed by name until it is decided.
    __crash_dump__: ClassVar[dict[str, Any]] = {
        "request_id": "value",
        "prompt_token_ids": "count",
        "sampling_params": "nested",
        "eos_token_ids": "count",
        "arrival_time": "value",
        "output_token_ids": "count",
        "block_ids": "value",
        "num_computed_tokens": "value",
        "block_hashes": "count",  # derived from token ids: never the values
        "num_hashed_blocks": "value",
        "num_cached_tokens": "value",
        "cache_key": "is_set",
        "prompt_logprobs": "count",
        "num_preemptions": "value",
        "status": "value",
        "stop_reason": "is_set",
        "first_scheduled_time": "value",
        "trace_link": "is_set",
        "grammar": "is_set",
        "spec": "nested",
        "num_new_tokens": "value",
    }

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + outputs."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and finish the request if it hit a stop condition (its
        grammar, if any, complete, or refusing the token: then `grammar.error` says why)."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        grammar = self.grammar
        if grammar is not None and (grammar.accept(token_id) or grammar.error is not None):
            self.status = RequestStatus.FINISHED_STOPPED
        elif token_id in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id
        elif not params.ignore_eos and token_id in self.eos_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)
