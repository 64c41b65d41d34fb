"""The Responses API's object is declared once: what the handlers write has the document's
fields, and the part it repeats of its request is `ResponsesEcho`'s, in its order."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from otel_engine.entrypoints.openai.api_kind import ApiKind
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    ResponseObject,
    ResponsesEcho,
)
from otel_engine.entrypoints.openai.responses import response_object
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest
from otel_engine.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent / "golden" / "wire.json"


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


WHOLE_ANSWERS = {
    "completion whole": CompletionResponse,
    "chat whole": ChatCompletionResponse,
    "chat_tools whole": ChatCompletionResponse,
    "responses whole": ResponseObject,
    "responses_tools whole": ResponseObject,
}


@pytest.mark.parametrize("name", sorted(WHOLE_ANSWERS))
def test_each_recorded_answer_is_its_documented_model(name: str) -> None:
    """The wire bytes (written fast, by dict builders) and the OpenAPI document's models
    cannot drift apart: each recorded whole answer validates against its model, and the
    model, read back, gives the same object (no field the document lacks, none it requires
    left out)."""
    written = json.loads(json.loads(GOLDEN.read_text(encoding="utf-8"))[name])
    model = WHOLE_ANSWERS[name].model_validate(written)

    assert written == model.model_dump(mode="json", exclude_unset=True)
