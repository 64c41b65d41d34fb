"""Front-end output processing: incremental detokenization and stop strings.

Runs where the client is (api_server or the `LLM` caller), not in the engine core. Text is
decoded one token at a time with `tokenizers`' DecodeStream (correct across multi-byte
characters). Stop strings are searched in the decoded text; a match finishes the request
here and asks the engine core to abort it. Streamed text never shows a partial stop
string: a suffix that could still grow into one is held back until it cannot.

Everything here costs a bounded amount per new character, whatever the stop strings: the
api_server runs it on its event loop. A request whose output cannot be processed fails on
its own; the other requests of the step go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenizers.decoders import DecodeStream

from otel_engine.errors import OtelEngineError, RequestError, RequestFailedError
from otel_engine.ipc.messages import RequestUpdate, StepOutputs
from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.outputs import (
    CompletionOutput,
    FinishReason,
    GrowingPrefix,
    RequestOutput,
    TokenIds,
    TokenLogprobs,
)
from otel_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StopMatcher:
    """Finds stop strings in text that grows at the end, in time linear in the new text.

    One Knuth-Morris-Pratt automaton per stop string: `states[i]` is the length of the
    longest prefix of stop string i that the text ends with, which is also how much text
    must be held back from a stream while that stop string could still complete.
    """

    __slots__ = ("_tables", "states", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._tables = [_prefix_table(stop) for stop in stops]
        self.states = [0] * len(stops)

    @property
    def held_back(self) -> int:
        return max(self.states, default=0)

    def feed(self, text: str, start: int) -> tuple[int, str] | None:
        """Advance over `text[start:]`; the earliest-starting match, as (index, stop)."""
        best: tuple[int, str] | None = None
        end = len(text)
        for index, stop in enumerate(self.stops):
            state = self.states[index]
            position = start
            if not state:  # fast path: nothing can start before the stop's first character
                position = text.find(stop[0], start)
                if position < 0:
                    continue
            table = self._tables[index]
            size = len(stop)
            while position < end:
                char = text[position]
                while state and stop[state] != char:
                    state = table[state - 1]
                if stop[state] == char:
                    state += 1
                position += 1
                if state == size:
                    begin = position - size
                    if best is None or begin < best[0]:
                        best = (begin, stop)
                    break
            self.states[index] = state
        return best


def _prefix_table(pattern: str) -> list[int]:
    """table[i]: length of the longest proper prefix of pattern[: i + 1] that is also its
    suffix (the Knuth-Morris-Pratt failure function)."""
    table = [0] * len(pattern)
    length = 0
    for index in range(1, len(pattern)):
        while length and pattern[index] != pattern[length]:
            length = table[length - 1]
        if pattern[index] == pattern[length]:
            length += 1
        table[index] = length
    return table


@dataclass(slots=True)
class RequestState:
    """What the front end tracks per in-flight request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: DecodeStream
    arrival_time: float
    stops: StopMatcher | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_emitted_chars: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # per output token, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 2..n, when asked


class Processed(NamedTuple):
    """One step, processed: outputs to deliver, requests the engine must abort (a stop
    string matched, or their output failed), and the requests that failed, with why."""

    outputs: list[RequestOutput]
    to_abort: list[str]
    failures: list[tuple[str, OtelEngineError]]


class OutputProcessor:
    """Turns engine `StepOutputs` into `RequestOutput`s for the callers."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self._backend = tokenizer.backend_tokenizer
        self.states: dict[str, RequestState] = {}

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        arrival_time: float,
    ) -> None:
        stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        stops = StopMatcher(params.stop) if params.stop else None
        self.states[request_id] = RequestState(
            request_id, prompt_token_ids, params, prompt, stream, arrival_time, stops
        )
        if params.logprobs is not None:
            self.states[request_id].logprobs = []

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(self, step: StepOutputs) -> Processed:
        processed = Processed([], [], [])
        now = time.time()
        for update in step.updates:
            state = self.states.get(update.request_id)
            if state is None:
                continue
            if update.rejected is not None:
                del self.states[state.request_id]
                rejected = update.rejected
                error: OtelEngineError
                if rejected.is_server_error:
                    error = RequestFailedError(rejected.message, code=rejected.code)
                else:
                    error = RequestError(rejected.message, code=rejected.code, param=rejected.param)
                processed.failures.append((state.request_id, error))
                continue
            try:
                output, matched_stop = self._advance(state, update, now)
            except Exception as exc:  # a bug or bad data in one request's output
                logger.exception("request.output_failed", extra={"request_id": update.request_id})
                del self.states[state.request_id]
                failure = RequestFailedError(f"output processing failed: {type(exc).__name__}")
                processed.failures.append((state.request_id, failure))
                if update.finish_reason is None:
                    processed.to_abort.append(state.request_id)
                continue
            if matched_stop and update.finish_reason is None:
                processed.to_abort.append(state.request_id)
            processed.outputs.append(output)
        return processed

    def _advance(
        self, state: RequestState, update: RequestUpdate, now: float
    ) -> tuple[RequestOutput, bool]:
        """Detokenize one update, match stop strings, cut what may be streamed."""
        finish_reason = update.finish_reason
        # a stop token id from the core, or the stop string matched here
        stop_reason: str | int | None = update.stop_reason
        _record_timing(state, update, now)
        start = len(state.token_ids)
        backend = self._backend
        matched = None
        # Token by token: an update of several (speculative decoding kept proposals) ends
        # at the token that completes a stop string, as one token per update would.
        for token_id in update.new_token_ids:
            num_chars_before = len(state.text)
            state.token_ids.append(token_id)
            piece = state.stream.step(backend, token_id)
            if piece:
                state.text += piece
            found = state.stops.feed(state.text, num_chars_before) if state.stops else None
            if found is not None:
                state.text = state.text[: found[0]]
                matched = found[1]
                finish_reason, stop_reason = FinishReason.STOP, matched
                break
        if update.prompt_logprobs is not None:
            state.prompt_logprobs = update.prompt_logprobs
        logprobs = state.logprobs
        if logprobs is not None and update.logprobs is not None:
            logprobs += update.logprobs[: len(state.token_ids) - start]
        finished = finish_reason is not None
        end = len(state.text)
        if not finished and state.stops is not None:
            end -= state.stops.held_back
        delta_text = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = max(state.num_emitted_chars, end)
        completion = CompletionOutput(
            index=0,
            text=state.text[: state.num_emitted_chars],
            token_ids=TokenIds(state.token_ids),
            delta_text=delta_text,
            delta_token_ids=state.token_ids[start:],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        if logprobs is not None:
            completion.logprobs = GrowingPrefix(logprobs)
            completion.delta_logprobs = logprobs[start:]
        if finished:
            state.metrics["finished_time"] = now
            del self.states[state.request_id]
        output = RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt=state.prompt,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs,
        )
        return output, matched is not None


def _record_timing(state: RequestState, update: RequestUpdate, now: float) -> None:
    """Wall-clock timings for metrics and spans: arrival, queue, first token, preemptions,
    and the prompt tokens found in the prefix cache."""
    metrics = state.metrics
    if not metrics:
        metrics["arrival_time"] = state.arrival_time
        metrics["first_token_time"] = now
    if update.queue_time_s is not None:
        metrics["queue_time_s"] = update.queue_time_s
    if update.num_cached_tokens is not None:
        metrics["num_cached_tokens"] = update.num_cached_tokens
    metrics["num_preemptions"] = update.num_preemptions
    if update.num_draft_tokens:
        metrics["num_draft_tokens"] = metrics.get("num_draft_tokens", 0) + update.num_draft_tokens
        metrics["num_accepted_tokens"] = (
            metrics.get("num_accepted_tokens", 0) + update.num_accepted_tokens
        )
