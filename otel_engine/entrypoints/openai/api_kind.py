"""Which OpenAI API a request came in on: what its id starts with, the operation its span and
metrics name, and the `object` of its answer. The kind travels with the request (`Job.kind`);
nothing reads it back from the id."""

from __future__ import annotations

from enum import StrEnum


class ApiKind(StrEnum):
    """`POST /v1/completions`, `/v1/chat/completions` or `/v1/responses`."""

    COMPLETION = "completion"
    CHAT = "chat"
    RESPONSES = "responses"

    @property
    def id_prefix(self) -> str:
        """The request id (the response id) is this prefix, a dash and 32 hex digits."""
        return _ID_PREFIXES[self]

    @property
    def operation(self) -> str:
        """`gen_ai.operation.name`: a Responses request is a chat to the model."""
        return "text_completion" if self is ApiKind.COMPLETION else "chat"

    def object_name(self, is_chunk: bool) -> str:
        """The `object` field of a whole answer, or of a streamed chunk."""
        whole, chunk = _OBJECTS[self]
        return chunk if is_chunk else whole


_ID_PREFIXES = {ApiKind.COMPLETION: "cmpl", ApiKind.CHAT: "chatcmpl", ApiKind.RESPONSES: "resp"}
_OBJECTS = {
    ApiKind.COMPLETION: ("text_completion", "text_completion"),
    ApiKind.CHAT: ("chat.completion", "chat.completion.chunk"),
    ApiKind.RESPONSES: ("response", "response"),
}
