"""What the server sends, as pydantic models for the OpenAPI document.

The handlers build their bodies with msgspec (fast; rendering.py, responses.py); these models
describe them, so that clients and fuzzers can check every answer against the document. The
part of a response object that repeats its request (`ResponsesEcho`) is declared once, here:
the handlers carry it on the job and write its fields as declared.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from otel_engine.outputs import FinishReason


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


# The finish reasons an answer may carry (an aborted request gets an error instead).
ApiFinishReason = Literal[FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS]


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
    finish_reason: ApiFinishReason


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
    finish_reason: ApiFinishReason


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


class ResponsesEcho(BaseModel):
    """What a response object repeats of its request (temperature and top_p: the sampling it
    got), the last fields of `ResponseObject`, in its order. Responses are not stored and
    their input is never truncated, whatever the request said."""

    # every answer has the defaulted fields too: the document lists them as required
    model_config = ConfigDict(json_schema_serialization_defaults_required=True)

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: None = None
    metadata: dict[str, str]
    store: Literal[False] = False
    truncation: Literal["disabled"] = "disabled"


class ResponseObject(ResponsesEcho):
    """`POST /v1/responses` without `stream` (with it: server-sent events `response.created`,
    `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
    `response.output_text.delta`, `response.function_call_arguments.delta`, their `.done`
    events, then `response.completed` or `response.incomplete`, or `error` and
    `response.failed`)."""

    # On the wire these come first, then `ResponsesEcho`'s (responses.response_object).
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponsesMessageItem | ResponsesFunctionCallItem]
    usage: ResponsesUsage | None
    error: ResponsesError | None
    incomplete_details: ResponsesIncomplete | None
