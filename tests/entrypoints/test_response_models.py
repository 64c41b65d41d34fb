"""The Responses API's object is declared once: what the handlers write has the document's
fields, and the part it repeats of its request is `ResponsesEcho`'s, in its order."""

from __future__ import annotations

import msgspec

from otel_engine.entrypoints.openai.api_kind import ApiKind
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.response_models import ResponseObject, ResponsesEcho
from otel_engine.entrypoints.openai.responses import response_object
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest
from otel_engine.sampling_params import SamplingParams


def _written(**request: object) -> dict[str, object]:
    """The response object the handlers write for `request`, as a client decodes it."""
    params = SamplingParams(temperature=0.5, max_tokens=8)
    job = Job(
        request_id="resp-1",
        kind=ApiKind.RESPONSES,
        model="m",
        request_model="m",
        prompt_ids=[1, 2],
        params=params,
        include_usage=False,
    )
    echo = ResponsesRequest.model_validate({"input": "hi", **request}).echo(params)
    body = response_object(job, echo, status="in_progress", output=[])
    return msgspec.json.decode(msgspec.json.encode(body))  # type: ignore[no-any-return]


def test_the_written_object_is_the_documented_one() -> None:
    """Every field the document declares is written, and nothing else; the body validates."""
    written = _written(instructions="Be brief.", metadata={"k": "v"})

    assert set(ResponseObject.model_fields) == set(written)
    ResponseObject.model_validate(written)


def test_the_echo_is_written_last_in_its_declared_order() -> None:
    written = list(_written())
    echoed = list(ResponsesEcho.model_fields)

    assert echoed == written[-len(echoed) :]


def test_the_echo_says_what_the_request_got() -> None:
    """temperature is the sampling the request got; store and truncation what the server
    does, whatever the request said."""
    written = _written(store=True, truncation="auto", tool_choice="none")

    assert (0.5, False, "disabled", "none", None) == (
        written["temperature"],
        written["store"],
        written["truncation"],
        written["tool_choice"],
        written["previous_response_id"],
    )
