"""OpenAI-compatible request bodies: the only place otel-engine uses pydantic.

Each request model is validated strictly (a string is not an integer) and converted at once
into plain values: a prompt, a `SamplingParams`. Fields of the OpenAI API that the engine does
not implement are rejected when set to a non-default value instead of being silently ignored;
unknown fields are ignored so that newer clients keep working.
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from otel_engine.entrypoints.errors import APIError, bad_request
from otel_engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16

TokenIds = list[int]


def unsupported(param: str, message: str) -> APIError:
    return bad_request(message, param=param, code="unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    """`stream_options`: `include_usage` adds a last chunk with usage and no choices."""

    include_usage: bool = False


class _SamplingFields(_Strict):
    """Sampling fields shared by completions and chat completions (vLLM extras included)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Reject OpenAI features the engine does not implement."""
        if self.n != 1:
            raise unsupported("n", "only n=1 is supported")
        if self.frequency_penalty:
            raise unsupported("frequency_penalty", "frequency_penalty is not supported")
        if self.presence_penalty:
            raise unsupported("presence_penalty", "presence_penalty is not supported")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported")

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's `SamplingParams` for this request, validated."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )
        params.validate()
        return params


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt` is text, token ids, or a list holding one of those."""

    prompt: str | TokenIds | list[str] | list[TokenIds]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name) not in (None, False):
                raise unsupported(name, f"{name} is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "only best_of=1 is supported")

    def single_prompt(self) -> str | TokenIds:
        """The one prompt of this request (batches of prompts are not supported)."""
        prompt: object = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise unsupported("prompt", "exactly one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt", code="invalid_value")
        return cast("str | TokenIds", prompt)


class ContentPart(_Strict):
    """One part of a message's content; only `text` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Strict):
    """One chat message, passed to the model's chat template as `{role, content}`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise unsupported("messages", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, object]] | None = None
    response_format: dict[str, object] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise unsupported("logprobs", "logprobs are not supported")
        if self.tools:
            raise unsupported("tools", "tools are not supported")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", "only the text response_format is supported")

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [message.to_template_dict() for message in self.messages]
