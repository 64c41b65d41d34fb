"""The one check a request passes before it may run: parameters, token ids, context.

The front end calls it to answer 400 before anything is sent; the engine core calls it
again on admission, because the core must never trust its input: a request it cannot run
is refused on its own (a per-request error), and the engine keeps serving.
"""

from __future__ import annotations

from collections.abc import Sequence

from otel_engine.errors import RequestError
from otel_engine.sampling_params import SamplingParams, shown


def check_request(
    token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """Raise `RequestError` (with `code` and `param`) unless the request can run.

    The length is checked before the per-token range, so the cost is bounded by the
    context length whatever the client sent.
    """
    params.validate(vocab_size)
    num_prompt = len(token_ids)
    if not num_prompt:
        raise RequestError("the prompt is empty", code="invalid_prompt", param="prompt")
    if num_prompt + params.max_tokens > max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens; the "
            f"prompt has {num_prompt} tokens and max_tokens is {shown(params.max_tokens)}",
            code="context_length_exceeded",
            param="max_tokens" if num_prompt < max_model_len else "prompt",
        )
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise RequestError(
            f"prompt token ids must be in [0, {vocab_size})", code="invalid_prompt", param="prompt"
        )
