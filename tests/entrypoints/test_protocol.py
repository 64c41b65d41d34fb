"""Request models: strict validation and conversion to `SamplingParams`, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from otel_engine.entrypoints.network.errors import APIError
from otel_engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def test_sampling_params_carry_every_field() -> None:
    """OpenAI fields and vLLM extras reach SamplingParams unchanged."""
    request = CompletionRequest.model_validate_json(
        '{"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,'
        ' "stop": ["a", "b"], "stop_token_ids": [2], "ignore_eos": true}'
    )

    params = request.to_sampling_params(max_tokens=11)

    assert (11, 0.5, 0.9, 7, 3) == (
        params.max_tokens,
        params.temperature,
        params.top_p,
        params.top_k,
        params.seed,
    )
    assert (("a", "b"), (2,), True) == (params.stop, params.stop_token_ids, params.ignore_eos)


def test_single_stop_string_becomes_a_tuple() -> None:
    """`stop` as one string is one stop string."""
    request = CompletionRequest(prompt="x", stop="END")

    assert ("END",) == request.to_sampling_params(max_tokens=1).stop


@pytest.mark.parametrize("prompt", ["hi", [1, 2], ["hi"], [[1, 2]]])
def test_single_prompt_unwraps_one_element_lists(prompt: object) -> None:
    """A prompt, or a list holding exactly one prompt, is accepted."""
    request = CompletionRequest.model_validate({"prompt": prompt})

    assert request.single_prompt() in ("hi", [1, 2])


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", "b"]])
def test_empty_or_batched_prompt_is_refused(prompt: object) -> None:
    """Empty prompts and batches of prompts are 400s naming `prompt`."""
    request = CompletionRequest.model_validate({"prompt": prompt})

    with pytest.raises(APIError) as excinfo:
        request.single_prompt()

    assert (400, "prompt") == (excinfo.value.status, excinfo.value.param)


def test_strings_are_not_coerced_to_numbers() -> None:
    """Validation is strict: "5" is not an integer."""
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"prompt": "x", "max_tokens": "5"}')


def test_unknown_fields_are_ignored() -> None:
    """Fields this server does not know (newer clients) do not fail the request."""
    request = CompletionRequest.model_validate_json('{"prompt": "x", "metadata": {"a": 1}}')

    assert "x" == request.prompt


def test_the_routers_no_op_fields_are_not_reported_as_ignored() -> None:
    """vllm-router writes these into every request it forwards: at their no-op values they
    are not a client's typo, and a fleet's logs are not a warning per request; any other
    value is still reported."""
    forwarded = {
        "messages": [{"role": "user", "content": "hi"}],
        "no_stop_trim": False,
        "continue_final_message": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "return_hidden_states": False,
        "include_reasoning": True,
        "metadata": {"a": 1},
    }
    assert ["metadata"] == ChatCompletionRequest.model_validate(forwarded).ignored_fields()
    changed = {**forwarded, "continue_final_message": True, "return_hidden_states": 0}
    assert ["continue_final_message", "return_hidden_states", "metadata"] == (
        ChatCompletionRequest.model_validate(changed).ignored_fields()
    )
    completion = CompletionRequest.model_validate(
        {"prompt": "x", "no_stop_trim": False, "return_hidden_states": False}
    )
    assert [] == completion.ignored_fields()


def test_max_completion_tokens_wins() -> None:
    """Chat: max_completion_tokens takes precedence over max_tokens."""
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9,
            "max_completion_tokens": 4,
        }
    )

    assert 4 == request.requested_max_tokens()


def test_text_content_parts_are_joined() -> None:
    """A message's text parts become one content string for the template."""
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )

    assert [{"role": "user", "content": "ab"}] == request.template_messages()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("suffix", "x"),
    ],
)
def test_unsupported_features_are_refused(field: str, value: object) -> None:
    """Features the engine lacks are refused with a 400 naming them, not silently ignored."""
    request = CompletionRequest.model_validate({"prompt": "x", field: value})

    with pytest.raises(APIError) as excinfo:
        request.check_supported()

    assert (400, field) == (excinfo.value.status, excinfo.value.param)


def test_include_usage_only_when_streaming() -> None:
    """stream_options.include_usage counts only for streaming requests."""
    body = {"prompt": "x", "stream_options": {"include_usage": True}}

    assert not CompletionRequest.model_validate(body).include_usage
    assert CompletionRequest.model_validate({**body, "stream": True}).include_usage


def test_penalties_bias_and_extras_reach_the_sampling_params() -> None:
    """OpenAI's penalties and logit_bias, and vLLM's repetition_penalty, min_p, min_tokens."""
    body = {
        "prompt": "x",
        "presence_penalty": 0.5,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.3,
        "min_p": 0.05,
        "min_tokens": 3,
        "logit_bias": {"17": -100, "4": 2.5},
    }
    request = CompletionRequest.model_validate(body)
    request.check_supported()

    params = request.to_sampling_params(16)

    assert (0.5, -1.0, 1.3, 0.05, 3, ((17, -100.0), (4, 2.5))) == (
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        params.min_p,
        params.min_tokens,
        params.logit_bias,
    )
    assert params.has_logits_processing


@pytest.mark.parametrize("key", ["abc", "-1", "1.5", "", "\u0661"])
def test_logit_bias_keys_must_be_token_ids(key: str) -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {key: 1.0}})

    with pytest.raises(APIError) as excinfo:
        request.to_sampling_params(16)

    assert (400, "logit_bias") == (excinfo.value.status, excinfo.value.param)
