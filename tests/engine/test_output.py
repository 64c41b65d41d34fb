"""The front end's output processor: incremental detokenization (multi-byte safe), stop
strings cut from the text and never streamed in part, and finish reasons."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_engine.engine.output import OutputProcessor, StopMatcher
from otel_engine.errors import RequestError, RequestFailedError
from otel_engine.ipc.messages import RequestRejected, RequestUpdate, StepOutputs
from otel_engine.model.loader import load_tokenizer
from otel_engine.outputs import RequestOutput
from otel_engine.sampling_params import SamplingParams
from tests.helpers.tiny_model import IM_END

MULTIBYTE = "héllo wörld 世界 🌍"
UNSEEN = "東京 🎉 ñandú Ωmega"  # characters the tokenizer never saw: split into bytes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    return load_tokenizer(tiny_model_dir)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def feed(
    processor: OutputProcessor,
    token_ids: list[int],
    *,
    request_id: str = "r",
    last_finish: str | None = None,
) -> tuple[list[RequestOutput], list[str]]:
    """Send token ids one step at a time; the last update carries `last_finish`."""
    outputs: list[RequestOutput] = []
    aborts: list[str] = []
    for index, token_id in enumerate(token_ids):
        finish = last_finish if index == len(token_ids) - 1 else None
        step = StepOutputs(
            step_id=index + 1, updates=[RequestUpdate(request_id, [token_id], finish)]
        )
        results, to_abort, _ = processor.process(step)
        outputs += results
        aborts += to_abort
        if results and results[-1].finished:
            break
    return outputs, aborts


def start(tokenizer: Any, params: SamplingParams, request_id: str = "r") -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    processor.add(request_id, [1, 2, 3], params, "prompt", time.time())
    return processor


def deltas(outputs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].delta_text for o in outputs)


@pytest.mark.parametrize("text", [MULTIBYTE, UNSEEN])
def test_multibyte_text_decodes_one_token_at_a_time(tokenizer: Any, text: str) -> None:
    """Fed one token per step, the deltas add up to the full decode, with no broken characters."""
    token_ids = encode(tokenizer, text)
    processor = start(tokenizer, SamplingParams(max_tokens=64))

    outputs, _ = feed(processor, token_ids, last_finish="length")

    assert tokenizer.decode(token_ids) == deltas(outputs)
    assert text == outputs[-1].outputs[0].text
    assert all("\ufffd" not in o.outputs[0].delta_text for o in outputs)


def test_unseen_characters_span_several_tokens(tokenizer: Any) -> None:
    """The test text above really splits characters: some tokens alone are not valid UTF-8."""
    token_ids = encode(tokenizer, UNSEEN)

    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)


def test_text_and_token_ids_are_cumulative(tokenizer: Any) -> None:
    """Each output's text and token ids extend the previous output's."""
    token_ids = encode(tokenizer, "The engine schedules requests in steps.")
    processor = start(tokenizer, SamplingParams(max_tokens=64))

    outputs, _ = feed(processor, token_ids, last_finish="length")

    for before, after in itertools.pairwise(outputs):
        assert after.outputs[0].text.startswith(before.outputs[0].text)
    assert token_ids == outputs[-1].outputs[0].token_ids
    assert token_ids == [t for o in outputs for t in o.outputs[0].delta_token_ids]


def test_engine_finish_reason_passes_through(tokenizer: Any) -> None:
    """A finish reason from the engine ends the request; the state is dropped."""
    processor = start(tokenizer, SamplingParams(max_tokens=3))

    outputs, aborts = feed(processor, encode(tokenizer, "one two three"), last_finish="length")

    assert [False] * (len(outputs) - 1) + [True] == [o.finished for o in outputs]
    assert "length" == outputs[-1].outputs[0].finish_reason
    assert [] == aborts
    assert {} == processor.states


def test_stop_string_is_cut_and_reported(tokenizer: Any) -> None:
    """The text ends before the stop string; finish reason "stop" names it; the engine is
    asked to abort the request."""
    text = "The engine schedules requests in steps."
    processor = start(tokenizer, SamplingParams(max_tokens=64, stop=("requests",)))

    outputs, aborts = feed(processor, encode(tokenizer, text))

    final = outputs[-1].outputs[0]
    assert "The engine schedules " == final.text
    assert ("stop", "requests") == (final.finish_reason, final.stop_reason)
    assert ["r"] == aborts
    assert final.text == deltas(outputs)


def test_partial_stop_string_is_never_streamed(tokenizer: Any) -> None:
    """A stop string spread over several tokens: nothing of it appears in any delta."""
    text = "héllo wörld 世界 🌍 naïve café"
    stop = "wörld 世"
    processor = start(tokenizer, SamplingParams(max_tokens=64, stop=(stop,)))

    outputs, _ = feed(processor, encode(tokenizer, text))

    final_text = outputs[-1].outputs[0].text
    assert "héllo " == final_text
    for output in outputs:
        assert final_text.startswith(output.outputs[0].text)
    assert final_text == deltas(outputs)


def test_held_back_text_is_released_when_no_stop_follows(tokenizer: Any) -> None:
    """A suffix that looks like the start of a stop string is held, then released."""
    text = "héllo wörld 世界 🌍"
    processor = start(tokenizer, SamplingParams(max_tokens=64, stop=("llox",)))

    outputs, _ = feed(processor, encode(tokenizer, text), last_finish="length")

    decoded = [tokenizer.decode(o.outputs[0].token_ids) for o in outputs]
    assert any(len(o.outputs[0].text) < len(d) for o, d in zip(outputs, decoded, strict=True))
    assert text == deltas(outputs)
    assert "length" == outputs[-1].outputs[0].finish_reason


def test_earliest_of_several_stop_strings_wins(tokenizer: Any) -> None:
    """With two stop strings in the text, the cut is at the one that starts first."""
    text = "A quick brown fox jumps over the lazy dog."
    processor = start(tokenizer, SamplingParams(max_tokens=64, stop=("lazy", "brown")))

    outputs, _ = feed(processor, encode(tokenizer, text))

    assert ("A quick ", "brown") == (
        outputs[-1].outputs[0].text,
        outputs[-1].outputs[0].stop_reason,
    )


def test_stop_string_on_the_engines_last_token_is_not_aborted(tokenizer: Any) -> None:
    """When the engine already finished the request, a stop match changes the reason only."""
    processor = start(tokenizer, SamplingParams(max_tokens=3, stop=("fox",)))

    outputs, aborts = feed(processor, encode(tokenizer, "A quick brown fox"), last_finish="length")

    assert [] == aborts
    assert ("stop", "fox") == (
        outputs[-1].outputs[0].finish_reason,
        outputs[-1].outputs[0].stop_reason,
    )


@pytest.mark.parametrize(("skip", "expected"), [(True, "hi"), (False, f"hi{IM_END}")])
def test_special_tokens_follow_skip_special_tokens(
    tokenizer: Any, skip: bool, expected: str
) -> None:
    """The end-of-turn token is dropped from the text only when skip_special_tokens is set."""
    token_ids = [*encode(tokenizer, "hi"), tokenizer.convert_tokens_to_ids(IM_END)]
    processor = start(tokenizer, SamplingParams(max_tokens=8, skip_special_tokens=skip))

    outputs, _ = feed(processor, token_ids, last_finish="stop")

    assert expected == outputs[-1].outputs[0].text


def test_updates_for_unknown_requests_are_ignored(tokenizer: Any) -> None:
    """An update for a request the front end no longer tracks produces nothing."""
    processor = start(tokenizer, SamplingParams())

    results, aborts, _ = processor.process(
        StepOutputs(step_id=1, updates=[RequestUpdate("gone", [5])])
    )

    assert ([], []) == (results, aborts)


def test_requests_in_one_step_are_decoded_separately(tokenizer: Any) -> None:
    """Two requests interleaved in the same steps keep their own text."""
    processor = OutputProcessor(tokenizer)
    first, second = encode(tokenizer, "héllo wörld"), encode(tokenizer, "世界 🌍 café")
    for request_id in ("a", "b"):
        processor.add(request_id, [1], SamplingParams(max_tokens=64), None, time.time())
    texts = {"a": "", "b": ""}
    for index in range(max(len(first), len(second))):
        updates = [
            RequestUpdate(rid, [ids[index]], "length" if index == len(ids) - 1 else None)
            for rid, ids in (("a", first), ("b", second))
            if index < len(ids)
        ]
        results, _, _ = processor.process(StepOutputs(step_id=index + 1, updates=updates))
        for result in results:
            texts[result.request_id] += result.outputs[0].delta_text

    assert {"a": "héllo wörld", "b": "世界 🌍 café"} == texts


def _reference_cut(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest-starting occurrence of any stop string (the definition)."""
    found = [(text.find(s), s) for s in stops if s in text]
    return min(found, key=lambda pair: pair[0]) if found else None


def _reference_held_back(text: str, stops: tuple[str, ...]) -> int:
    """Longest suffix of `text` that is a proper prefix of a stop string (the definition)."""
    return max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab世", max_size=6), max_size=30),
    stops=st.lists(st.text(alphabet="ab世", min_size=1, max_size=7), min_size=1, max_size=4),
)
def test_stop_matcher_agrees_with_the_definition(pieces: list[str], stops: list[str]) -> None:
    """Fed text piece by piece, StopMatcher finds the same earliest stop string as a search
    of the whole text, and holds back exactly the suffix that could start a stop string."""
    matcher = StopMatcher(tuple(stops))
    text = ""
    for piece in pieces:
        start = len(text)
        text += piece
        found = matcher.feed(text, start)
        expected = _reference_cut(text, tuple(stops))
        if found is not None or expected is not None:
            assert expected == found
            return
        assert _reference_held_back(text, tuple(stops)) == matcher.held_back


def test_stop_matching_costs_time_linear_in_the_text() -> None:
    """16 stop strings of the longest length built to defeat naive matching: feeding 20,000
    characters a few at a time takes about as long as a tenth of them, times ten."""
    from otel_engine.sampling_params import MAX_STOP_CHARS

    stops = tuple("a" * (MAX_STOP_CHARS - 2) + f"b{i}" for i in range(16))

    def feed_chars(num_chars: int) -> float:
        matcher = StopMatcher(stops)
        text = ""
        started = time.perf_counter()
        while len(text) < num_chars:
            start = len(text)
            text += "aaaa"
            assert matcher.feed(text, start) is None
        return time.perf_counter() - started

    small, large = feed_chars(2_000), feed_chars(20_000)

    assert large < 30 * small + 0.05


def test_a_request_whose_output_fails_fails_alone(tokenizer: Any) -> None:
    """An update the detokenizer cannot take (a negative token id) fails that request with
    RequestFailedError and aborts it in the engine; the other request of the step goes on."""
    processor = OutputProcessor(tokenizer)
    for request_id in ("bad", "good"):
        processor.add(request_id, [1], SamplingParams(max_tokens=8), None, time.time())
    good_ids = encode(tokenizer, "hello")

    processed = processor.process(
        StepOutputs(
            step_id=1,
            updates=[RequestUpdate("bad", [-5]), RequestUpdate("good", good_ids[:1])],
        )
    )

    assert ["good"] == [o.request_id for o in processed.outputs]
    assert ["bad"] == processed.to_abort
    assert [("bad", RequestFailedError)] == [(i, type(e)) for i, e in processed.failures]
    assert ["good"] == list(processor.states)


def test_a_request_the_engine_refused_fails_with_its_reason(tokenizer: Any) -> None:
    """A refusal from the engine core becomes the request's RequestError (code, param)."""
    processor = start(tokenizer, SamplingParams())
    rejected = RequestRejected("invalid_value", "top_k is too large", "top_k")

    processed = processor.process(
        StepOutputs(step_id=0, updates=[RequestUpdate("r", [], "abort", rejected=rejected)])
    )

    [(request_id, error)] = processed.failures
    assert isinstance(error, RequestError)
    assert ("r", "invalid_value", "top_k") == (request_id, error.code, error.param)
    assert {} == processor.states


def test_an_output_handed_out_does_not_change_later(tokenizer: Any) -> None:
    """The token ids of an output already given to the caller stay as they were while the
    request goes on (they are not the engine's growing list)."""
    processor = start(tokenizer, SamplingParams(max_tokens=64))
    token_ids = encode(tokenizer, "The engine schedules requests in steps.")

    outputs, _ = feed(processor, token_ids, last_finish="length")

    first = outputs[0].outputs[0].token_ids
    assert [token_ids[0]] == first
    assert 1 == len(first)
    assert [token_ids[0]] == list(first)
    assert token_ids == outputs[-1].outputs[0].token_ids


def test_an_update_of_several_tokens_ends_at_the_stop_string(tokenizer: Any) -> None:
    """Speculative decoding's updates carry several tokens: the ones after the token that
    completes a stop string are dropped (text, token ids and their logprobs), as if each
    token had come alone."""
    from otel_engine.outputs import TokenLogprobs

    params = SamplingParams(max_tokens=50, stop=("STOP",), logprobs=0)
    processor = start(tokenizer, params)
    before, after = encode(tokenizer, "one two STOP"), encode(tokenizer, " three four")
    tokens = before + after
    logprobs = [TokenLogprobs(-0.5, [], []) for _ in tokens]
    step = StepOutputs(step_id=1, updates=[RequestUpdate("r", tokens, logprobs=logprobs)])

    [output], to_abort, _ = processor.process(step)

    completion = output.outputs[0]
    assert completion.text == "one two "
    assert list(completion.token_ids) == before
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(before)
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "STOP")
    assert to_abort == ["r"]
