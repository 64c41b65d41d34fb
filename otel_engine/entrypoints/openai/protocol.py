"""OpenAI-compatible request bodies: the only place otel-engine uses pydantic.

Each request model is validated strictly (a string is not an integer) and converted at once
into plain values: a prompt, a `SamplingParams`. An integer field takes what JSON Schema calls
an integer (`1` and `1.0`, not `1.5` or `"1"`), and no text field takes a lone UTF-16
surrogate (`"\ud800"`), which nothing downstream could encode. Fields of the OpenAI API that
the engine does not implement are rejected when set to a non-default value instead of being
silently ignored; unknown fields are ignored, so that newer clients keep working, with a
warning and a counter (`ignored_fields`), never silently.

A numeric field is marked with its `Bound` (`Bounded`): the sampling fields with the one in
`sampling_params.BOUNDS` that `SamplingParams.validate` holds, `n` and `best_of` with the
edge's own. `check_bounds` refuses a value outside it in the engine's words, before any
tokenization, and the OpenAPI document states it (`minimum`, `maximum`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from otel_engine.engine.structured_output import from_response_format
from otel_engine.entrypoints.network.errors import APIError, bad_request, from_request_error
from otel_engine.entrypoints.network.limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from otel_engine.entrypoints.tools.plan import MAX_TOOLS, Function, template_call
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import (
    BOUNDS,
    Bound,
    SamplingParams,
    StructuredOutput,
    apply_generation_defaults,
)

MAX_CHOICES = 16  # n and best_of
# A token id of any vocabulary has fewer digits; a longer key is refused before int().
MAX_TOKEN_ID_DIGITS = 19


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _no_surrogates(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return value


# An integer as JSON Schema has it: 2.0 is the integer 2 (strict mode alone refuses it).
Int = Annotated[int, BeforeValidator(_integral)]
# Text that can be encoded as UTF-8.
Text = Annotated[str, AfterValidator(_no_surrogates)]
# Token ids stay plain: a per-item validator would cost a Python call per id.
TokenIds = list[int]


@dataclass(frozen=True, slots=True)
class Bounded:
    """Field metadata: the field's value must lie in `bound` (`check_bounds` holds it, the
    OpenAPI document states it)."""

    bound: Bound

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler(schema), **self.bound.json_schema()}


def bounded(name: str) -> Bounded:
    """The bound `SamplingParams.validate` holds the field `name` to."""
    return Bounded(BOUNDS[name])


CHOICES = Bounded(Bound(1, MAX_CHOICES))  # n and best_of


def unsupported(param: str, message: str) -> APIError:
    return bad_request(message, param=param, code=ErrorCode.UNSUPPORTED_PARAMETER)


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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def check_bounds(self) -> None:
        """A 400 naming the first field outside its bound, in `SamplingParams.validate`'s
        words ("temperature must be in [0, 2], got 5")."""
        for name, bound in _bounds(type(self)):
            value = getattr(self, name)
            if value is not None:
                try:
                    bound.check(name, value)
                except RequestError as error:
                    raise from_request_error(error) from None


@cache
def _bounds(model: type[BaseModel]) -> list[tuple[str, Bound]]:
    """The bounded fields of `model`, in declaration order."""
    return [
        (name, mark.bound)
        for name, info in model.model_fields.items()
        for mark in info.metadata
        if isinstance(mark, Bounded)
    ]


class StreamOptions(_Strict):
    """`stream_options`: `include_usage` adds a last chunk with usage and no choices."""

    include_usage: bool = False


class _SamplingFields(_Strict):
    """Sampling fields shared by completions and chat completions (vLLM extras included).
    Unknown fields are kept aside (`ignored_fields`) so that the server can say it ignored
    them instead of dropping them silently."""

    model_config = ConfigDict(strict=True, extra="allow")

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
            "logprobs": self.requested_logprobs(),
            "prompt_logprobs": self.requested_prompt_logprobs(),
            "structured_output": self.structured_output(),
        }
        for name in (defaults or {}).keys() - self.model_fields_set:
            del given[name]
        return apply_generation_defaults(given, defaults or {})

    def structured_output(self) -> StructuredOutput | None:
        """`response_format` as the engine's spec (None: text); 400 for a malformed one."""
        try:
            return from_response_format(self.response_format)
        except RequestError as error:
            raise from_request_error(error) from None


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


class ContentPart(_Strict):
    """One part of a message's content; only `text` parts are supported."""

    type: Text
    text: Text | None = None


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")]


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    """A function the model may call (the only kind of tool there is on this endpoint)."""

    type: Literal["function"]
    function: FunctionDefinition

    def to_function(self) -> Function:
        return Function(self.function.name, self.function.description, self.function.parameters)


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: Text
    arguments: Text


class MessageToolCall(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
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
            message["tool_calls"] = [template_call(call.model_dump()) for call in self.tool_calls]
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
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
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


class ResponsesFunctionTool(_Strict):
    """A function tool of the Responses API (its fields flat, not under `function`)."""

    type: Text
    name: FunctionName | None = None
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Text | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Strict):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Strict):
    """`POST /v1/responses`: `input` (text, or message and function-call items) and
    `instructions` become a chat for the model's template; the answer is output items.
    Responses are not stored, so `previous_response_id` is refused."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    model: Text | None = None
    input: Text | Annotated[list[dict[str, object]], Field(max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, object] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[Int | None, bounded("max_tokens")] = None
    temperature: Annotated[float, bounded("temperature")] = 1.0
    top_p: Annotated[float, bounded("top_p")] = 1.0
    text: ResponsesText | None = None
    stream: bool = False
    previous_response_id: Text | None = None
    store: bool | None = None
    background: bool | None = None
    conversation: object | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    seed: Annotated[Int | None, bounded("seed")] = None
    # accepted and without effect here: no reasoning, no truncation of the input
    reasoning: dict[str, object] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise unsupported(
                "previous_response_id",
                "responses are not stored: send the whole conversation as input items",
            )
        if self.background:
            raise unsupported("background", "background responses are not supported")
        if self.conversation is not None:
            raise unsupported("conversation", "conversations are not stored")
        for tool in self.tools or ():
            if tool.type != "function" or tool.name is None:
                raise unsupported("tools", f"only function tools are supported, not {tool.type!r}")

    def ignored_fields(self) -> list[str]:
        return list(self.model_extra or {})

    def response_format(self) -> dict[str, object] | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_ or {}},
        }

    def tool_functions(self) -> list[Function] | None:
        if not self.tools:
            return None
        return [Function(t.name or "", t.description, t.parameters) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if isinstance(choice, dict):  # {"type": "function", "name": ...}
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def template_messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages (400 `input` for an item that is not
        a message, a function call or its output)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        for index, item in enumerate(self.input):
            _input_item(item, index, messages)
        if not messages:
            raise bad_request("input is empty", param="input", code=ErrorCode.INVALID_VALUE)
        return messages


_ROLES = ("system", "developer", "user", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _item_text(value: object, param: str) -> str:
    if isinstance(value, str):
        return _no_surrogates(value)
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(param, f"only text content parts are supported, not {kind!r}")
            texts.append(_item_text(part.get("text", ""), param))
        return "".join(texts)
    raise bad_request(
        f"{param} must be text or text parts", param=param, code=ErrorCode.INVALID_VALUE
    )


def _input_item(item: dict[str, object], index: int, messages: list[dict[str, Any]]) -> None:
    """Append one Responses input item to `messages` as the chat template reads it."""
    param = f"input[{index}]"
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"{param}.role must be one of {_ROLES}", param="input", code=ErrorCode.INVALID_VALUE
            )
        messages.append({"role": role, "content": _item_text(item.get("content", ""), "input")})
    elif kind == "function_call":
        name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
        if not all(isinstance(v, str) for v in (name, arguments, call_id)):
            raise bad_request(
                f"{param} needs name, arguments and call_id as strings",
                param="input",
                code=ErrorCode.INVALID_VALUE,
            )
        call = template_call(
            {"id": call_id, "function": {"name": name, "arguments": _no_surrogates(str(arguments))}}
        )
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                f"{param} needs a call_id", param="input", code=ErrorCode.INVALID_VALUE
            )
        output = _item_text(item.get("output", ""), "input")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind != "reasoning":  # a reasoning item of another server: nothing to render here
        raise unsupported("input", f"input items of type {str(kind)[:32]!r} are not supported")


class TokenizeRequest(_Strict):
    """`POST /tokenize` (vLLM's shape): `prompt` text, or chat `messages` rendered with the
    model's chat template, exactly one of them."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True  # for `prompt` (a chat template writes its own)
    add_generation_prompt: bool = True  # for `messages`


class DetokenizeRequest(_Strict):
    """`POST /detokenize` (vLLM's shape): token ids in, text out."""

    model: Text | None = None
    tokens: TokenIds


# ---- Responses: what the server sends, for the OpenAPI document only ----------------------
# The handlers build their bodies with msgspec (fast); these models describe them, so that
# clients and fuzzers can check every answer against the document.


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error: 400, 401, 404, 408, 413, 500, 503."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(BaseModel):
    """Per generated token: its text, logprob, top alternatives and offset in the text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # with echo, the prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """`POST /v1/completions` without `stream` (with it: server-sent events, one
    `text_completion` chunk per event, then `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as the model wrote them: a JSON object")


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    """`POST /v1/chat/completions` without `stream` (with it: server-sent events of
    `chat.completion.chunk` objects, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class RankDifference(BaseModel):
    key: str = Field(description="dotted, e.g. `paths.int4_kernels.enabled`")
    values: list[Any] = Field(description="each rank's value, by rank (null: the rank has none)")


class FastPathPlans(BaseModel):
    """Each rank's fast-path plan (`executor/rank_plans.py`), and where the ranks differ."""

    ranks: list[dict[str, Any]] = Field(
        description="each rank's plan, by rank: cpu_isa, kernel_isa, paths (each enabled or "
        "not, and why), choices; what that rank's start log said (kernels.selected)"
    )
    ranks_differ: bool = Field(description="not every rank runs the same plan")
    differences: list[RankDifference] = Field(
        description="each key whose value is not the same on every rank"
    )


class MemoryBandwidthCard(BaseModel):
    """Decode speed against the machine's limit (`observability/decode_bandwidth.py`): rank
    0's measured memory read bandwidth and its recent steps of decodes alone."""

    peak_bytes_per_second: int | None = Field(
        description="the read bandwidth rank 0's threads measured at start (null: not measured)"
    )
    peak_num_threads: int | None = Field(description="the threads that measured it")
    peak_is_cached: bool | None = Field(
        description="read from an earlier start's probe (the cache beside the kernel builds)"
    )
    decode_bytes_per_second: int | None = Field(
        description="weights and KV cache bytes the decode-only steps of about the last "
        "second read, over their time"
    )
    decode_ratio: float | None = Field(description="decode_bytes_per_second over the peak")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    sampling_defaults: dict[str, float] = Field(
        description="what a request that omits these fields gets (--generation-config)"
    )
    fast_paths: FastPathPlans | None = Field(
        default=None, description="the fast paths the model runs, on each rank"
    )
    memory_bandwidth: MemoryBandwidthCard | None = Field(
        default=None, description="decode speed against the measured memory read bandwidth"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class LoadResponse(BaseModel):
    """GET /get_load, the load vLLM's router polls for its power_of_two policy."""

    load: int = Field(description="generation requests in flight in this server")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ResponsesOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponsesMessageItem(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[ResponsesOutputText]


class ResponsesFunctionCallItem(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as the model wrote them: a JSON object")
    status: Literal["in_progress", "completed", "incomplete"]


class ResponsesInputTokensDetails(BaseModel):
    cached_tokens: int


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails
    total_tokens: int


class ResponsesError(BaseModel):
    code: str
    message: str


class ResponsesIncomplete(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """`POST /v1/responses` without `stream` (with it: server-sent events `response.created`,
    `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
    `response.output_text.delta`, `response.function_call_arguments.delta`, their `.done`
    events, then `response.completed` or `response.incomplete`, or `error` and
    `response.failed`)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponsesMessageItem | ResponsesFunctionCallItem]
    usage: ResponsesUsage | None
    error: ResponsesError | None
    incomplete_details: ResponsesIncomplete | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: None
    metadata: dict[str, str]
    store: bool
    truncation: str
