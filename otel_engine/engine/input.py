"""Front-end input processing: tokenize and validate a prompt before it reaches the engine."""

from __future__ import annotations

from typing import Any

from otel_engine.errors import RequestError
from otel_engine.sampling_params import SamplingParams


class InputProcessor:
    """Checks a request against the model's limits; raises `RequestError` with a code."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        params.validate()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise RequestError("the prompt is empty", code="invalid_prompt")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise RequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", code="invalid_prompt"
            )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {self.vocab_size})")
        num_prompt = len(token_ids)
        if num_prompt + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {num_prompt} tokens and max_tokens is {params.max_tokens}",
                code="context_length_exceeded",
            )
        return token_ids
