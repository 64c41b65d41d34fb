"""Request lifetime on the HTTP side: client disconnects, drain deadlines, the transport of
server-sent events (their frames are the API's: the caller's `events` and `error_frame`).

A `RequestWatch` races a request's work (waiting for the first token, collecting the
completion, streaming chunks) against the client going away and against the server's drain
deadline. Losing the race cancels the work, which closes the engine's output generator and so
aborts the request in the engine: its KV blocks are freed at once, not when the text would
have been complete. The work runs in the context the watch was created in (the request's
span and `request_id`), even when a streaming response runs it after the handler returned.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from otel_engine.entrypoints.network.connections import CLIENT_READER_KEY, ClientReader
from otel_engine.entrypoints.network.errors import APIError, draining

T = TypeVar("T")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RequestWatch:
    """Watches one request for a client disconnect and for the end of the drain period."""

    def __init__(self, receive: Receive, drain_expired: asyncio.Event) -> None:
        self._context = contextvars.copy_context()
        self._disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        self._drain = asyncio.ensure_future(drain_expired.wait())

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work`; raise `ClientDisconnected` or a 503 `APIError` if it lost the race."""
        task = asyncio.get_running_loop().create_task(work, context=self._context.copy())
        try:
            await asyncio.wait(
                {task, self._disconnect, self._drain}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if not task.cancelled():
            return task.result()
        if self._disconnect.done():
            raise ClientDisconnected
        raise draining()

    def close(self) -> None:
        self._disconnect.cancel()
        self._drain.cancel()


class EventStreamResponse(Response):
    """Server-sent events from `events`, raced against the request's `RequestWatch`.

    `events` yields complete SSE frames and handles engine errors itself (as error events);
    `error_frame` is the frame that ends a stream the drain deadline cut. This class only
    handles the transport: disconnects, the drain deadline, and a client that does not read:
    once the connection's `ClientReader` says the client is behind, the request is held in
    the engine (`hold(True)`, its slot goes to others) until the client has taken what was
    written, then released (`hold(False)`).
    """

    def __init__(
        self,
        events: AsyncIterator[bytes],
        watch: RequestWatch,
        error_frame: Callable[[APIError], bytes],
        hold: Callable[[bool], None] | None = None,
    ) -> None:
        super().__init__(status_code=200)
        self._events = events
        self._watch = watch
        self._error_frame = error_frame
        self._hold = hold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        reader = scope.get(CLIENT_READER_KEY)
        try:
            await self._watch.run(self._pump(send, reader))
        except ClientDisconnected:
            pass
        except APIError as error:
            frame = self._error_frame(error)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
            self._watch.close()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send, reader: ClientReader | None) -> None:
        hold = self._hold if reader is not None else None
        async for frame in self._events:
            await send({"type": "http.response.body", "body": frame, "more_body": True})
            if hold is not None and reader.is_behind:  # type: ignore[union-attr]
                hold(True)
                if not await reader.caught_up():  # type: ignore[union-attr]
                    return  # aborted as write_stalled, or gone: the request ends
                hold(False)
