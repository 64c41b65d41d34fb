"""Sampling fields over HTTP with the official client: penalties, logit bias and vLLM's
extras are applied; out-of-range values are 400s naming the field; unknown fields are
ignored with a warning and a counter, never silently."""

from __future__ import annotations

import logging
import time

import openai
import pytest

from tests.entrypoints.conftest import Served

pytestmark = pytest.mark.slow  # starts engine processes


def test_penalties_bias_and_extras_are_accepted_on_both_endpoints(served: Served) -> None:
    """The shapes evaluation harnesses and agent frameworks send answer 200."""
    client = served.openai()
    options = {
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "logit_bias": {"5": -100, "9": 3},
        "extra_body": {"repetition_penalty": 1.2, "min_p": 0.05, "min_tokens": 2},
    }

    completion = client.completions.create(
        model=served.model, prompt="Once upon a time", max_tokens=4, **options
    )
    chat = client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **options
    )

    assert completion.usage is not None
    assert completion.usage.completion_tokens >= 2
    assert chat.usage is not None
    assert chat.usage.completion_tokens >= 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("min_p", 2.0),
        ("min_tokens", 100),
        ("logit_bias", {"5": 150}),
        ("logit_bias", {"999999999": 1}),
        ("logit_bias", {"hello": 1}),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(
    served: Served, field: str, value: object
) -> None:
    client = served.openai()

    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(
            model=served.model, prompt="hi", max_tokens=4, extra_body={field: value}
        )

    assert field == excinfo.value.body["param"]  # type: ignore[index]


def test_unknown_fields_are_ignored_with_a_warning_and_a_counter(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo'd field is not applied: the request is served, one warning names the fields,
    the counter counts them."""
    before = served.metric("otel_engine_ignored_request_fields_total")
    client = served.openai()

    with caplog.at_level(logging.WARNING, logger="otel_engine.api_server"):
        client.completions.create(
            model=served.model,
            prompt="hi",
            max_tokens=2,
            extra_body={"temprature": 0.2, "x" * 200: 1},
        )

    [record] = [r for r in caplog.records if r.getMessage() == "request.ignored_fields"]
    assert ["temprature", "x" * 64] == record.fields  # type: ignore[attr-defined]
    assert 2 == served.metric("otel_engine_ignored_request_fields_total") - before


def test_unknown_fields_warn_a_line_a_second_and_count_every_request(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 3, item 4: requests that each carry unknown fields (here 20, with 16 long names
    apiece) log a `request.ignored_fields` line a second at most; the counter counts all."""
    before = served.metric("otel_engine_ignored_request_fields_total")
    fields = {f"{'y' * 60}{k}": 1 for k in range(16)}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="otel_engine.api_server"), served.http() as http:
        for _ in range(20):
            body = {"prompt": "", "max_tokens": 1, **fields}  # refused: the prompt is empty
            assert 400 == http.post("/v1/completions", json=body).status_code
    elapsed = time.monotonic() - started

    lines = [r for r in caplog.records if r.getMessage() == "request.ignored_fields"]
    assert len(lines) <= 1 + elapsed
    assert 20 * 16 == served.metric("otel_engine_ignored_request_fields_total") - before
