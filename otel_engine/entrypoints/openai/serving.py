"""The OpenAI completion endpoints: prompt preparation, limits and admission; running the
admitted job and answering it are runner.py's.

Prompts are tokenized here, so that the context limit is checked (and the default
`max_tokens` chosen) before the engine sees the request. Tokenization and chat templates run
in a worker thread, never on the event loop, after a character limit that bounds their cost;
so does building a chat's messages from its body, which is proportional to its history. A
chat's tools are checked against their schemas and its grammar is made only once its prompt
fits the context (`ToolSupport.draft`, then `constrain`).
The engine request id is the response id (`cmpl-<hex>`, `chatcmpl-<hex>`, `resp-<hex>`: the
request's `ApiKind`), so logs, spans and the client agree.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from otel_engine.engine import structured_output
from otel_engine.engine.chat import ChatRenderer, NoChatTemplateError
from otel_engine.engine.validation import check_context
from otel_engine.entrypoints.network.errors import (
    APIError,
    bad_request,
    from_engine_error,
    from_request_error,
)
from otel_engine.entrypoints.network.limits import MESSAGE_OVERHEAD_CHARS
from otel_engine.entrypoints.openai.api_kind import ApiKind
from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from otel_engine.entrypoints.openai.responses_request import ResponsesRequest, responses_param
from otel_engine.entrypoints.openai.runner import JobRunner
from otel_engine.entrypoints.tools.plan import Function, ToolPlan, ToolSupport
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.observability.log_limits import RateLimitedLog
from otel_engine.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from otel_engine import AsyncLLM
    from otel_engine.observability.metrics import EngineMetrics

logger = logging.getLogger("otel_engine.api_server")

T = TypeVar("T")

DEFAULT_COMPLETION_MAX_TOKENS = 16
# An ignored field is logged by name: at most this many names, each cut to this length.
MAX_LOGGED_FIELDS = 16
MAX_FIELD_NAME_CHARS = 64


class OpenAIServing:
    """Turns validated OpenAI requests into admitted jobs (`runner.JobRunner` runs them and
    answers)."""

    def __init__(
        self,
        engine: AsyncLLM,
        metrics: EngineMetrics,
        drain_expired: asyncio.Event,
        max_prompt_chars: int,
        *,
        allow_special_tokens_in_content: bool = False,
        tool_call_parser: str = "auto",
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.drain_expired = drain_expired
        self.max_prompt_chars = max_prompt_chars
        self.log_prompts = engine.config.observability.log_prompts
        self.allow_special_tokens_in_content = allow_special_tokens_in_content
        self.tool_call_parser = tool_call_parser
        self.runner = JobRunner(engine, metrics, drain_expired)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._warnings = RateLimitedLog(logger)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_common(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            prompt_ids = await self._off_loop(self.engine.encode, prompt)
        else:
            prompt_ids = prompt
        await self._off_loop(body.structured_output)  # made once, in the tokenizer thread
        job = self._admit(
            body,
            prompt_ids,
            kind=ApiKind.COMPLETION,
            default_cap=DEFAULT_COMPLETION_MAX_TOKENS,
            prompt_param="prompt",
        )
        await self._check_grammar(job.params)
        if body.echo and isinstance(prompt, str):
            job.echo = prompt
        elif body.echo:
            job.echo = await self._off_loop(self.engine.decode, prompt)
        return await self.runner.run(job, body.stream, request, prompt)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_common(body)
        job, text = await self._chat_job(
            body,
            body.template_messages,
            body.tool_functions(),
            body.tool_choice_value(),
            body.parallel_tool_calls,
            kind=ApiKind.CHAT,
            prompt_param="messages",
        )
        return await self.runner.run(job, body.stream, request, text)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """`POST /v1/responses`: the request as a chat (its messages, tools, limits), the
        answer as output items (responses.py)."""
        body.check_bounds()
        self._check_model(body.model)
        body.check_supported()
        self._warn_ignored(body.ignored_fields())
        try:
            job, text = await self._chat_job(
                body.as_chat(),
                body.template_messages,
                body.tool_functions(),
                body.tool_choice_value(),
                body.parallel_tool_calls,
                kind=ApiKind.RESPONSES,
                prompt_param="input",
            )
        except APIError as error:  # the chat's names for this API's fields
            error.param = responses_param(error.param)
            raise
        job.responses = await self._off_loop(body.echo, job.params)  # its tools and schema
        return await self.runner.run(job, body.stream, request, text)

    async def _chat_job(
        self,
        body: ChatCompletionRequest,
        messages_of: Callable[[], list[dict[str, Any]]],
        functions: list[Function] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel: bool,
        *,
        kind: ApiKind,
        prompt_param: str,
    ) -> tuple[Job, str]:
        """A chat's job: its prompt (tools and earlier calls in the model's terms) within the
        context, then its grammar (tools, response_format) valid."""
        plan, answer_format, text, prompt_ids = await self._off_loop(
            self._chat_prompt, body.structured_output, messages_of, functions, tool_choice, parallel
        )
        job = self._admit(body, prompt_ids, kind=kind, default_cap=None, prompt_param=prompt_param)
        if plan is not None:
            await self._off_loop(self._constrain, plan, answer_format)
            job.tools = plan
            job.params = msgspec.structs.replace(
                job.params,
                structured_output=plan.structured,
                num_tools=len(plan.functions),
                skip_special_tokens=job.params.skip_special_tokens and plan.keep_special is None,
            )
        await self._check_grammar(job.params)
        return job, text

    def _chat_prompt(
        self,
        answer_format_of: Callable[[], StructuredOutput | None],
        messages_of: Callable[[], list[dict[str, Any]]],
        functions: list[Function] | None,
        tool_choice: str | dict[str, Any] | None,
        parallel: bool,
    ) -> tuple[ToolPlan | None, StructuredOutput | None, str, list[int]]:
        """In the tokenizer thread: the answer's format (`answer_format_of`: a schema is
        serialized, up to the body's size, before its size is checked), the chat's messages
        (`messages_of`), their characters within the budget, the request's tool plan drafted,
        and the prompt's text and ids."""
        answer_format = answer_format_of()
        messages = messages_of()
        self._check_chars(chat_chars(messages, functions), "messages")
        try:
            plan = self._tools.draft(functions, tool_choice, parallel, answer_format)
        except RequestError as error:
            raise from_request_error(error) from None
        messages = self._template_messages(messages, plan)
        text, prompt_ids = self._render(messages, True, self._tools.template_tools(plan))
        return plan, answer_format, text, prompt_ids

    def _template_messages(
        self, messages: list[dict[str, Any]], plan: ToolPlan | None
    ) -> list[dict[str, Any]]:
        """`messages` as the template gets them (`ToolSupport.messages`), held to the budget
        again: decoded, a call's arguments can be longer than as written (`9e15` is
        `9000000000000000.0`)."""
        try:
            messages = self._tools.messages(messages, plan)
        except RequestError as error:
            raise from_request_error(error) from None
        functions = plan.functions if plan is not None and self._tools.native else None
        self._check_chars(chat_chars(messages, functions), "messages")
        return messages

    def _constrain(self, plan: ToolPlan, answer_format: StructuredOutput | None) -> None:
        """In the tokenizer thread: the tools' schemas checked, the plan's grammar made
        (milliseconds per tool)."""
        try:
            self._tools.constrain(plan, answer_format)
        except RequestError as error:
            raise from_request_error(error) from None

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's `/tokenize`: the token ids of a prompt or of rendered chat messages."""
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request(
                "give exactly one of prompt and messages",
                param="prompt",
                code=ErrorCode.INVALID_VALUE,
            )
        if body.prompt is not None:
            self._check_chars(len(body.prompt), "prompt")
            ids = await self._off_loop(self.engine.encode, body.prompt, body.add_special_tokens)
        else:
            ids = await self._off_loop(self._tokenize_chat, body)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def _tokenize_chat(self, body: TokenizeRequest) -> list[int]:
        """In the tokenizer thread: the token ids of `body.messages`, rendered as a chat's."""
        messages = [m.to_template_dict() for m in body.messages or ()]
        self._check_chars(chat_chars(messages), "messages")
        return self._render(self._template_messages(messages, None), body.add_generation_prompt)[1]

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's `/detokenize`: the text of token ids (special tokens included)."""
        self._check_model(body.model)
        try:
            text = await self._off_loop(self.engine.decode, body.tokens)
        except RequestError as error:
            raise from_engine_error(error) from None
        return {"prompt": text}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(
                404,
                f"model '{model}' does not exist",
                param="model",
                code=ErrorCode.MODEL_NOT_FOUND,
            )

    def _check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What a request must pass before any tokenization: its bounds, its model, the
        features it asks for."""
        body.check_bounds()
        self._check_model(body.model)
        body.check_supported()
        self._warn_ignored(body.ignored_fields())

    def _warn_ignored(self, ignored: list[str]) -> None:
        """Count the fields no part of the API knows; name them in a line a second at most."""
        if ignored:
            self.metrics.on_ignored_fields(len(ignored))
            self._warnings.log(
                logging.WARNING,
                "request.ignored_fields",
                fields=[name[:MAX_FIELD_NAME_CHARS] for name in ignored[:MAX_LOGGED_FIELDS]],
                num_fields=len(ignored),
            )

    async def _check_grammar(self, params: SamplingParams) -> None:
        """A `response_format` schema llguidance cannot build is a 400 naming the problem
        (checked in the tokenizer thread: a large schema takes milliseconds)."""
        if params.structured_output is not None:
            try:
                await self._off_loop(structured_output.check, params.structured_output)
            except RequestError as error:
                raise from_request_error(error) from None

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context before spending any work on it."""
        if num_chars > self.max_prompt_chars:
            what = (
                f"the messages count {num_chars} characters ({MESSAGE_OVERHEAD_CHARS} a "
                "message for the chat template)"
                if param == "messages"
                else f"the prompt has {num_chars} characters"
            )
            raise bad_request(
                f"{what}; at most {self.max_prompt_chars} are accepted (--max-prompt-chars)",
                param=param,
                code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            )

    async def _off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work in this server's tokenizer thread (one: a tokenizer is safe
        from several threads, but one keeps this work to one core)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, function, *args)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def _admit(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        *,
        kind: ApiKind,
        default_cap: int | None,
        prompt_param: str,
    ) -> Job:
        max_model_len = self.engine.max_model_len
        num_prompt = len(prompt_ids)
        remaining = max_model_len - num_prompt
        requested = body.requested_max_tokens()
        try:  # the one context rule and message (validation.py), with the prompt's field
            check_context(
                num_prompt,
                1 if requested is None else requested,
                max_model_len,
                self.engine.context_limited_by,
                prompt_param=prompt_param,
            )
        except RequestError as error:
            raise from_request_error(error) from None
        if requested is None:
            max_tokens = remaining if default_cap is None else min(remaining, default_cap)
        else:
            max_tokens = requested
        return Job(
            request_id=f"{kind.id_prefix}-{uuid.uuid4().hex}",
            kind=kind,
            model=self.engine.model_name,
            request_model=body.model or self.engine.model_name,
            prompt_ids=prompt_ids,
            params=body.to_sampling_params(max_tokens, self.engine.generation_defaults.values),
            include_usage=body.include_usage,
            n=body.n,
            num_samples=body.num_samples(),
            client_logprobs=body.requested_logprobs() is not None,
        )

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """A chat's prompt text and token ids (`ChatRenderer`); what it refuses, as a 400."""
        try:
            return self._chat.render(messages, add_generation_prompt, tools)
        except NoChatTemplateError as error:
            raise bad_request(
                f"{error.message}; use /v1/completions", param=error.param, code=error.code
            ) from None
        except RequestError as error:
            raise from_request_error(error) from None

    @cached_property
    def _chat(self) -> ChatRenderer:
        return ChatRenderer(
            self.engine.tokenizer, allow_special_tokens=self.allow_special_tokens_in_content
        )

    @cached_property
    def _tools(self) -> ToolSupport:
        return ToolSupport(self.engine.tokenizer, self.tool_call_parser)


def chat_chars(messages: list[dict[str, Any]], functions: list[Function] | None = None) -> int:
    """What a chat costs against the prompt-character budget: its text (earlier tool calls'
    names and arguments, as the client wrote them or, decoded, as JSON), plus the template's
    markup of each message (`MESSAGE_OVERHEAD_CHARS`), plus the tools' definitions as JSON."""
    total = 0
    for m in messages:
        total += len(m["content"]) + len(m.get("name", "")) + MESSAGE_OVERHEAD_CHARS
        for call in m.get("tool_calls", ()):
            function = call["function"]
            arguments = function["arguments"]
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            total += len(function["name"]) + len(arguments)
    for function in functions or ():
        total += len(json.dumps(function.definition(), ensure_ascii=False))
    return total
