"""The one check a request passes before it may run: parameters, token ids, context.

The front end calls it to answer 400 before anything is sent; the engine core calls it
again on admission, because the core must never trust its input: a request it cannot run
is refused on its own (a per-request error), and the engine keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_engine.errors import ErrorCode, RequestError
from otel_engine.model.limits import LimitedBy
from otel_engine.sampling_params import SamplingParams, shown

# Why the context is as long as it is, as a 400 and the start-up warning say it.
_LIMITED_BY = {
    LimitedBy.MODEL: "this model's maximum context length is {n} tokens",
    LimitedBy.MAX_MODEL_LEN: "this server's maximum context length is {n} tokens (--max-model-len)",
    LimitedBy.SLIDING_WINDOW: "this model's maximum context length is {n} tokens "
    "(its sliding window)",
    LimitedBy.KV_CACHE: (
        "this server's maximum context length is {n} tokens, all that its KV cache holds "
        "(--kv-cache-memory-gib or --num-kv-blocks raise it)"
    ),
}


def describe_context(max_model_len: int, limited_by: LimitedBy = LimitedBy.MODEL) -> str:
    """The context length and what sets it, in words."""
    return _LIMITED_BY[limited_by].format(n=max_model_len)


def check_context(
    num_prompt: int,
    max_tokens: int,
    max_model_len: int,
    limited_by: LimitedBy = LimitedBy.MODEL,
    *,
    prompt_param: str = "prompt",
) -> None:
    """Raise `RequestError` (`context_length_exceeded`) unless the prompt and `max_tokens`
    fit the context; `param` is the prompt's field when the prompt alone fills it."""
    if num_prompt + max_tokens > max_model_len:
        raise RequestError(
            f"{describe_context(max_model_len, limited_by)}; the prompt has {num_prompt} "
            f"tokens and max_tokens is {shown(max_tokens)}",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="max_tokens" if num_prompt < max_model_len else prompt_param,
        )


def check_request(
    token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    limited_by: LimitedBy = LimitedBy.MODEL,
    output_token_ids: Sequence[int] = (),
) -> None:
    """Raise `RequestError` (with `code` and `param`) unless the request can run.

    The length is checked before the per-token range, so the cost is bounded by the
    context length whatever the client sent. `output_token_ids` (a request carried over
    from an engine that died) must leave at least one token to generate.
    """
    params.validate(vocab_size)
    num_prompt = len(token_ids)
    if not num_prompt:
        raise RequestError("the prompt is empty", code=ErrorCode.INVALID_PROMPT, param="prompt")
    check_context(num_prompt, params.max_tokens, max_model_len, limited_by)
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError(
            f"prompt token ids must be in [0, {vocab_size})",
            code=ErrorCode.INVALID_PROMPT,
            param="prompt",
        )
    if output_token_ids and (
        len(output_token_ids) >= params.max_tokens
        or any(not 0 <= t < vocab_size for t in output_token_ids)
    ):
        raise RequestError(
            "the carried-over output does not fit the request",
            code=ErrorCode.INVALID_PROMPT,
            param="prompt",
        )
