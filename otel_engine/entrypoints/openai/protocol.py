"""OpenAI-compatible request bodies of the completions, chat, tokenize and detokenize
endpoints (the Responses API's is responses_request.py; the field types they share are
fields.py's): the only place otel-engine uses pydantic, besides those two.

Each request model is validated strictly (a string is not an integer) and converted at once
into plain values: a prompt, a `SamplingParams`. An integer field takes what JSON Schema calls
an integer (`1` and `1.0`, not `1.5` or `"1"`), and no text field takes a lone UTF-16
surrogate (`"\ud800"`), which nothing downstream could encode. Numbers are held to their
bounds by `check_bounds` (fields.py) before any tokenization. Fields of the OpenAI API that
the engine does not implement are rejected when set to a non-default value instead of being
silently ignored; unknown fields are ignored, so that newer clients keep working, with a
warning and a counter (`ignored_fields`), never silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import ConfigDict, Field, PrivateAttr

from otel_engine.engine.structured_output import from_response_format
from otel_engine.entrypoints.network.errors import bad_request, from_request_error
from otel_engine.entrypoints.network.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from otel_engine.entrypoints.openai.fields import (
    CHOICES,
    FunctionName,
    Int,
    Strict,
    Text,
    TokenIds,
    bounded,
    unsupported,
)
from otel_engine.entrypoints.tools.base import WireToolChoice
from otel_engine.entrypoints.tools.request import MAX_TOOLS, Function, wire_call
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import SamplingParams, StructuredOutput, apply_generation_defaults

# A token id of any vocabulary has fewer digits; a longer key is refused before int().
MAX_TOKEN_ID_DIGITS = 19


# vLLM's router (vllm-router) re-serializes every chat or completion request it forwards with
# these fields at these values, which ask for nothing this server does not already do (no
# trailing stop trimmed, no reasoning split, no hidden states); a request that sets one of them
# to anything else still has it reported as ignored.
ROUTER_NO_OPS: dict[str, bool] = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
_ABSENT = object()


class StreamOptions(Strict):
    """`stream_options`: `include_usage` adds a last chunk with usage and no choices."""

    include_usage: bool = False


class _SamplingFields(Strict):
    """Sampling fields shared by completions and chat completions (vLLM extras included).
    Unknown fields are kept aside (`ignored_fields`) so that the server can say it ignored
    them instead of dropping them silently."""

    model_config = ConfigDict(strict=True, extra="allow")
    # `structured_output()`'s result, once made (a 1-tuple: None is a text answer).
    _structured: tuple[StructuredOutput | None] | None = PrivateAttr(default=None)

    model: Text | None = None
    max_tokens: Annotated[Int | None, bounded("max_tokens")] = None
    temperature: Annotated[float, bounded("temperature")] = 1.0
    top_p: Annotated[float, bounded("top_p")] = 1.0
    top_k: Annotated[Int, bounded("top_k")] = 0
    seed: Annotated[Int | None, bounded("seed")] = None
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Annotated[Int, CHOICES] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Annotated[float, bounded("frequency_penalty")] = 0.0
    presence_penalty: Annotated[float, bounded("presence_penalty")] = 0.0
    repetition_penalty: Annotated[float, bounded("repetition_penalty")] = 1.0
    min_p: Annotated[float, bounded("min_p")] = 0.0
    min_tokens: Annotated[Int, bounded("min_tokens")] = 0
    logit_bias: dict[Text, float] | None = None
    response_format: dict[str, object] | None = None
    user: Text | None = None

    def check_supported(self) -> None:
        """Reject OpenAI features the engine does not implement."""

    def num_samples(self) -> int:
        """How many samples to draw (`best_of` on completions, else `n`)."""
        return self.n

    def ignored_fields(self) -> list[str]:
        """Fields of the body that no part of the API knows (a typo, a newer client's); the
        no-op defaults a router writes into every request it forwards are not among them."""
        return [
            name
            for name, value in (self.model_extra or {}).items()
            if ROUTER_NO_OPS.get(name, _ABSENT) is not value
        ]

    def token_logit_bias(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; its keys are token ids written as strings."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key[:20]!r}",
                    param="logit_bias",
                    code=ErrorCode.INVALID_VALUE,
                )
            if len(key) > MAX_TOKEN_ID_DIGITS:  # int() would refuse past 4,300 digits (a 500)
                raise bad_request(
                    f"logit_bias keys must be token ids, got a number of {len(key)} digits",
                    param="logit_bias",
                    code=ErrorCode.INVALID_VALUE,
                )
            pairs.append((int(key), bias))
        return tuple(pairs)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many top alternatives per token to report (None: no logprobs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (completions with `echo`)."""
        return None

    def to_sampling_params(
        self, max_tokens: int, defaults: Mapping[str, float] | None = None
    ) -> SamplingParams:
        """The engine's `SamplingParams` for this request (validated by the engine's rules
        when it is admitted); a field of `defaults` (the model's generation config) the
        request omits takes its value there."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        logprobs = self.requested_logprobs()
        if logprobs is None and self.num_samples() > self.n:
            logprobs = 0  # best_of > n ranks its samples by their cumulative logprobs
        given = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "min_tokens": self.min_tokens,
            "logit_bias": self.token_logit_bias(),
            "logprobs": logprobs,
            "prompt_logprobs": self.requested_prompt_logprobs(),
            "structured_output": self.structured_output(),
        }
        for name in (defaults or {}).keys() - self.model_fields_set:
            del given[name]
        return apply_generation_defaults(given, defaults or {})

    def structured_output(self) -> StructuredOutput | None:
        """`response_format` as the engine's spec (None: text); 400 for a malformed one.
        Serializing a schema costs up to the body's size, so serving calls this first in its
        tokenizer thread; later calls (`to_sampling_params`) get that result."""
        if self._structured is None:
            try:
                self._structured = (from_response_format(self.response_format),)
            except RequestError as error:
                raise from_request_error(error) from None
        return self._structured[0]


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt` is text, token ids, or a list holding one of those."""

    prompt: Text | TokenIds | list[Text] | list[TokenIds]
    echo: bool = False
    logprobs: Annotated[Int | None, bounded("logprobs")] = None
    best_of: Annotated[Int | None, CHOICES] = None
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix is not None:
            raise unsupported("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(
                "best_of must be at least n", param="best_of", code=ErrorCode.INVALID_VALUE
            )
        if self.stream and self.num_samples() > self.n:
            raise bad_request(
                "best_of > n cannot be streamed (the best samples are known at the end)",
                param="best_of",
                code=ErrorCode.INVALID_VALUE,
            )

    def num_samples(self) -> int:
        return self.best_of or self.n

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def single_prompt(self) -> str | TokenIds:
        """The one prompt of this request (batches of prompts are not supported)."""
        prompt: object = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise unsupported("prompt", "exactly one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise bad_request(
                "prompt must not be empty", param="prompt", code=ErrorCode.INVALID_VALUE
            )
        return cast("str | TokenIds", prompt)


class ContentPart(Strict):
    """One part of a message's content; only `text` parts are supported."""

    type: Text
    text: Text | None = None


class FunctionDefinition(Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDefinition(Strict):
    """A function the model may call (the only kind of tool there is on this endpoint)."""

    type: Literal["function"]
    function: FunctionDefinition

    def to_function(self) -> Function:
        return Function(self.function.name, self.function.description, self.function.parameters)


class NamedFunction(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(Strict):
    name: Text
    arguments: Text


class MessageToolCall(Strict):
    """A call an assistant message made earlier in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    """One chat message, passed to the model's chat template as `{role, content}` (and an
    assistant's `tool_calls`, a tool result's `tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None

    def to_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise unsupported("messages", "only text content parts are supported")
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request(
                    "only assistant messages have tool_calls",
                    param="messages",
                    code=ErrorCode.INVALID_VALUE,
                )
            message["tool_calls"] = [
                wire_call(call.id, call.function.name, call.function.arguments)
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[Int | None, bounded("max_tokens")] = None
    logprobs: bool = False
    top_logprobs: Annotated[Int | None, bounded("logprobs")] = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: WireToolChoice | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, object]] | None = None  # the API's deprecated form of tools
    function_call: str | dict[str, object] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request(
                "top_logprobs requires logprobs: true",
                param="top_logprobs",
                code=ErrorCode.INVALID_VALUE,
            )
        if self.functions is not None or self.function_call is not None:
            raise unsupported("functions", "functions and function_call are deprecated; use tools")

    def tool_functions(self) -> list[Function] | None:
        return [tool.to_function() for tool in self.tools] if self.tools else None

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template_dict() for message in self.messages]


class TokenizeRequest(Strict):
    """`POST /tokenize` (vLLM's shape): `prompt` text, or chat `messages` rendered with the
    model's chat template, exactly one of them."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # for `prompt` (a chat template writes its own)
    add_generation_prompt: bool = True  # for `messages`


class DetokenizeRequest(Strict):
    """`POST /detokenize` (vLLM's shape): token ids in, text out."""

    model: Text | None = None
    tokens: TokenIds
