"""Front-end output processing: incremental detokenization and stop strings.

Runs where the client is (api_server or the `LLM` caller), not in the engine core. Text is
decoded one token at a time with `tokenizers`' DecodeStream (correct across multi-byte
characters). Stop strings are searched in the decoded text; a match finishes the request
here and asks the engine core to abort it. Streamed text never shows a partial stop
string: a suffix that could still grow into one is held back until it cannot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from otel_engine.ipc.messages import RequestUpdate, StepOutputs
from otel_engine.outputs import CompletionOutput, RequestOutput
from otel_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the front end tracks per in-flight request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    stream: DecodeStream
    arrival_time: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_emitted_chars: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def held_back(self) -> int:
        """Length of the text suffix that could be the start of a stop string."""
        longest = 0
        for stop in self.params.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class OutputProcessor:
    """Turns engine `StepOutputs` into `RequestOutput`s for the callers."""

    def __init__(self, tokenizer: Any) -> None:
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
        self.states[request_id] = RequestState(
            request_id, prompt_token_ids, params, prompt, stream, arrival_time
        )

    def remove(self, request_id: str) -> RequestState | None:
        return self.states.pop(request_id, None)

    def process(self, step: StepOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to deliver and the request ids the engine must abort."""
        results = []
        to_abort = []
        now = time.time()
        for update in step.updates:
            state = self.states.get(update.request_id)
            if state is None:
                continue
            finish_reason = update.finish_reason
            # a stop token id from the core, or the stop string matched here
            stop_reason: str | int | None = update.stop_reason
            _record_timing(state, update, now)
            start = len(state.token_ids)
            num_chars_before = len(state.text)
            for token_id in update.new_token_ids:
                state.token_ids.append(token_id)
                piece = state.stream.step(self._backend, token_id)
                if piece:
                    state.text += piece
            matched = self._match_stop(state, num_chars_before)
            if matched is not None:
                if finish_reason is None:
                    to_abort.append(state.request_id)
                finish_reason, stop_reason = "stop", matched
            finished = finish_reason is not None
            end = len(state.text) if finished else len(state.text) - state.held_back()
            delta_text = state.text[state.num_emitted_chars : end]
            state.num_emitted_chars = max(state.num_emitted_chars, end)
            completion = CompletionOutput(
                index=0,
                text=state.text[: state.num_emitted_chars],
                token_ids=state.token_ids,
                delta_text=delta_text,
                delta_token_ids=state.token_ids[start:],
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
            if finished:
                state.metrics["finished_time"] = now
                del self.states[state.request_id]
            results.append(
                RequestOutput(
                    request_id=state.request_id,
                    prompt_token_ids=state.prompt_token_ids,
                    outputs=[completion],
                    finished=finished,
                    prompt=state.prompt,
                    metrics=state.metrics,
                )
            )
        return results, to_abort

    @staticmethod
    def _match_stop(state: RequestState, num_chars_before: int) -> str | None:
        """Find the earliest stop string; cut the text there (it is not part of the output)."""
        if not state.params.stop:
            return None
        best: tuple[int, str] | None = None
        for stop in state.params.stop:
            index = state.text.find(stop, max(0, num_chars_before - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        state.text = state.text[: best[0]]
        return best[1]


def _record_timing(state: RequestState, update: RequestUpdate, now: float) -> None:
    """Wall-clock timings for metrics and spans: arrival, queue, first token, preemptions."""
    metrics = state.metrics
    if not metrics:
        metrics["arrival_time"] = state.arrival_time
        metrics["first_token_time"] = now
    if update.queue_time_s is not None:
        metrics["queue_time_s"] = update.queue_time_s
    metrics["num_preemptions"] = update.num_preemptions
