"""A streamed Responses answer as it is written (`ResponseStream`): its output items (a
message, function calls) opened, filled and closed as the model's text and calls arrive,
each change one server-sent event with the next `sequence_number`; and the items as the
whole response object holds them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from otel_engine.entrypoints.openai.job import Job
from otel_engine.entrypoints.tools.parser import Delta, ToolCall


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if text or status != "in_progress" else [],
    }


def call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass(slots=True)
class ResponseStream:
    """The items of one streamed response as they are written, and its events numbered."""

    job: Job
    sequence: int = 0
    output: list[dict[str, Any]] = field(default_factory=list)  # items, in order
    message: dict[str, Any] | None = None  # the open message item
    text: str = ""
    call_items: dict[int, dict[str, Any]] = field(default_factory=dict)  # by call index
    open_call: int | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        frame = _event(kind, self.sequence, **fields)
        self.sequence += 1
        return frame

    def text_delta(self, piece: str) -> list[bytes]:
        frames = self.close_call()
        if self.message is None:
            self.message = message_item(new_item_id("msg"), "", "in_progress")
            self.output.append(self.message)
            index = len(self.output) - 1
            frames.append(
                self.event("response.output_item.added", output_index=index, item=self.message)
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        self.text += piece
        frames.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.output.index(self.message),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return frames

    def close_message(self, status: str = "completed") -> list[bytes]:
        message = self.message
        if message is None:
            return []
        self.message = None
        index = self.output.index(message)
        done = message_item(message["id"], self.text, status)
        self.output[index] = done
        part = done["content"][0]
        return [
            self.event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def call_delta(self, index: int, call: ToolCall) -> list[bytes]:
        """Call `index`, whole: the message or call before it closed, its item added, its
        arguments in one delta."""
        frames = [*self.close_message(), *self.close_call()]
        item: dict[str, Any] = {
            "type": "function_call",
            "id": new_item_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.output.append(item)
        self.call_items[index] = item
        self.open_call = index
        frames.append(
            self.event(
                "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
            )
        )
        piece = call.arguments
        if piece:
            item["arguments"] += piece
            frames.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.output.index(item),
                    delta=piece,
                )
            )
        return frames

    def close_call(self) -> list[bytes]:
        if self.open_call is None:
            return []
        item = self.call_items[self.open_call]
        self.open_call = None
        item["status"] = "completed"
        index = self.output.index(item)
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=dict(item)),
        ]

    def feed(self, delta: Delta) -> list[bytes]:
        frames: list[bytes] = []
        if delta.content:
            frames += self.text_delta(delta.content)
        for call in delta.calls:
            frames += self.call_delta(call.index, call.call)
        return frames
