"""Front-end input processing: tokenize and validate a prompt before it reaches the engine."""

from __future__ import annotations

from otel_engine.engine import structured_output
from otel_engine.engine.validation import check_request
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.model.limits import LimitedBy
from otel_engine.model.tokenizer import TokenizerLike
from otel_engine.sampling_params import SamplingParams


class InputProcessor:
    """Checks a request against the model's limits; raises `RequestError` with a code."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        max_model_len: int,
        vocab_size: int,
        limited_by: LimitedBy = LimitedBy.MODEL,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limited_by = limited_by  # what set max_model_len (EngineLimits.limited_by)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens included); `RequestError` when an id is
        outside the vocabulary or there are more than the context holds."""
        if len(token_ids) > self.max_model_len:
            raise RequestError(
                f"at most {self.max_model_len} tokens (the context length) can be detokenized",
                code=ErrorCode.INVALID_VALUE,
                param="tokens",
            )
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise RequestError(
                f"token ids must be in [0, {self.vocab_size})",
                code=ErrorCode.INVALID_VALUE,
                param="tokens",
            )
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=False))

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(
            token_ids,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            limited_by=self.limited_by,
        )
        if params.structured_output is not None:  # cached: the HTTP server checked it already
            structured_output.check(params.structured_output)
        return token_ids
