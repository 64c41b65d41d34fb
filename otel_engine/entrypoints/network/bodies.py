"""Request bodies: validated by pydantic off the event loop when large, and counted first.

FastAPI would parse and validate a body on the event loop, where 4 MB of small JSON objects
(140,000 empty chat messages) take most of a second and stall every other request, /health
included. `BodyRoute` validates each route's `body` with `BodyParser` instead: bodies up to
`INLINE_BODY_BYTES` on the loop (microseconds), larger ones in the `request-body` thread.
Before pydantic sees a body that holds chat messages (the app names those models), its
messages, content parts and earlier tool calls are counted on a compact decoding
(`check_chat_counts`), so a body over `MAX_MESSAGES`, `MAX_CONTENT_PARTS` or `MAX_TOOL_CALLS`
is a 400 after milliseconds, whatever it holds; and any body nested deeper than
`MAX_JSON_DEPTH` is a 400 before anything walks it by recursion. A request with a large body
that fails hands the memory it took back to the system (glibc keeps freed heap pages
otherwise). The OpenAPI document is FastAPI's own, from the same signatures.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
import typing
from collections.abc import Callable, Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import msgspec
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from otel_engine.entrypoints.network.errors import bad_request
from otel_engine.entrypoints.network.json_values import TOO_DEEP, json_value_problem
from otel_engine.entrypoints.network.limits import (
    MAX_CONTENT_PARTS,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_TOOL_CALLS,
)
from otel_engine.errors import ErrorCode
from otel_engine.memory import malloc_trim

M = TypeVar("M", bound=BaseModel)

INLINE_BODY_BYTES = 64 * 1024
# A failed request with a body of at least this size gives its memory back (malloc_trim), at
# most once per TRIM_INTERVAL_S.
TRIM_BODY_BYTES = 1024 * 1024
TRIM_INTERVAL_S = 1.0


class _Counted(msgspec.Struct):
    """A chat body as far as counting needs it: its messages, undecoded."""

    messages: list[msgspec.Raw] = []


class _CountedMessage(msgspec.Struct):
    """A message as far as counting needs it: each field undecoded, so that one of the wrong
    type (left for pydantic to refuse) does not keep the other from being counted."""

    content: msgspec.Raw = msgspec.Raw(b"null")
    tool_calls: msgspec.Raw = msgspec.Raw(b"null")


def _list_length(raw: msgspec.Raw) -> int:
    """The number of items of `raw` if it is a JSON list, else 0."""
    try:
        return len(msgspec.json.decode(raw, type=list[msgspec.Raw]))
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return 0


def check_chat_counts(raw: bytes) -> None:
    """400 for a chat body with more than `MAX_MESSAGES` messages, or `MAX_CONTENT_PARTS`
    content parts or `MAX_TOOL_CALLS` tool calls in all. A body that is not shaped like a
    chat is left to pydantic."""
    try:
        messages = msgspec.json.decode(raw, type=_Counted).messages
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return
    if len(messages) > MAX_MESSAGES:
        raise bad_request(
            f"a request has at most {MAX_MESSAGES} messages, this one has {len(messages)}",
            param="messages",
            code=ErrorCode.TOO_MANY_MESSAGES,
        )
    num_parts = num_calls = 0
    for message in messages:
        try:
            counted = msgspec.json.decode(message, type=_CountedMessage)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            continue
        num_parts += _list_length(counted.content)
        num_calls += _list_length(counted.tool_calls)
    for num, limit, what in (
        (num_parts, MAX_CONTENT_PARTS, "content parts"),
        (num_calls, MAX_TOOL_CALLS, "tool calls"),
    ):
        if num > limit:
            raise bad_request(
                f"a request has at most {limit} {what}, this one has {num}",
                param="messages",
                code=ErrorCode.TOO_MANY_MESSAGES,
            )


def check_depth(raw: bytes, value: object) -> None:
    """400 for a body (`value`, decoded from `raw`) nested deeper than `MAX_JSON_DEPTH`,
    naming its top-level field; a body with fewer brackets than that is not walked."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    fields = value.items() if isinstance(value, dict) else [("body", value)]
    for name, field in fields:
        problem = json_value_problem(field, check_strings=False)
        if problem is not None:
            param = name[:64].encode("utf-8", "replace").decode("utf-8")
            raise bad_request(f"{param}: {problem}", param=param, code=ErrorCode.INVALID_VALUE)


class BodyParser:
    """Validates request bodies into their pydantic models; large ones in one thread.
    `chat_models`: the models whose bodies hold chat messages, counted first."""

    def __init__(self, chat_models: Collection[type[BaseModel]] = ()) -> None:
        self._chat_models = frozenset(chat_models)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="request-body")
        self._trim = malloc_trim()
        self._last_trim = 0.0

    async def parse(self, model: type[M], raw: bytes) -> M:
        is_chat = model in self._chat_models
        if len(raw) <= INLINE_BODY_BYTES:
            return validate(model, raw, is_chat=is_chat)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._thread, functools.partial(validate, model, raw, is_chat=is_chat)
        )

    def refused(self, num_bytes: int) -> None:
        """A request of a `num_bytes` body failed: give its memory back to the system if it
        was large (see TRIM_BODY_BYTES)."""
        now = time.monotonic()
        if self._trim is None or num_bytes < TRIM_BODY_BYTES:
            return
        if now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            self._thread.submit(self._trim, 0)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def validate(model: type[M], raw: bytes, *, is_chat: bool = False) -> M:
    """`model` from a JSON body, parsed and validated as FastAPI would (the standard JSON
    parser, which keeps a lone surrogate for the field's own check to name); errors as
    FastAPI's (answered 400). A chat body (`is_chat`) has its messages counted first; any
    body nested past `MAX_JSON_DEPTH` is refused before pydantic walks it (`check_depth`)."""
    if is_chat:
        check_chat_counts(raw)
    try:
        value = json.loads(raw)
    except ValueError:  # not JSON, not UTF-8, an int past 4,300 digits
        error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
        raise RequestValidationError([error]) from None
    except RecursionError:  # the decoder's own bound, far past MAX_JSON_DEPTH
        raise bad_request(f"body: {TOO_DEEP}", code=ErrorCode.INVALID_VALUE) from None
    check_depth(raw, value)
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise RequestValidationError(error.errors(include_url=False)) from None


def body_route_class(parser: BodyParser) -> type[APIRoute]:
    """FastAPI's `route_class` for one app: its routes' bodies go through `parser`."""
    return type("AppBodyRoute", (BodyRoute,), {"parser": parser})


class BodyRoute(APIRoute):
    """An `APIRoute` whose endpoint's `body` parameter is validated by `BodyParser` (the
    endpoint gets it, and the `Request` if it asks); other routes are FastAPI's."""

    parser: ClassVar[BodyParser]

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        model = typing.get_type_hints(self.endpoint).get("body")
        if model is None:
            return super().get_route_handler()
        endpoint = self.endpoint
        wants_request = "request" in inspect.signature(endpoint).parameters
        parser = self.parser

        async def handle(request: Request) -> Response:
            raw = await request.body()
            try:
                body = await parser.parse(model, raw)
                result = await (endpoint(body, request) if wants_request else endpoint(body))
            except Exception:
                parser.refused(len(raw))
                raise
            if isinstance(result, Response):
                return result
            return Response(msgspec.json.encode(result), media_type="application/json")

        return handle
