"""msgpack encoders/decoders for each channel's message union (no pickle anywhere)."""

from __future__ import annotations

import traceback
from typing import Any, Generic, TypeVar

import msgspec

from otel_engine.ipc.messages import ErrorInfo

T = TypeVar("T")


class Codec(Generic[T]):
    """Encode any message; decode only the union `type_` that this channel carries."""

    def __init__(self, type_: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type_)

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)


def error_info(exc: BaseException, process: str, rank: int | None = None) -> ErrorInfo:
    """Flatten an exception into strings (never the exception object itself)."""
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception as format_error:  # a broken __str__ must not hide the original failure
        text = f"<traceback unavailable: {type(format_error).__name__}>"
    try:
        message = str(exc)
    except Exception:
        message = "<message unavailable>"
    return ErrorInfo(
        type=type(exc).__name__, message=message, traceback=text, process=process, rank=rank
    )
