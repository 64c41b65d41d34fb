"""What one client may cost the HTTP server: the limits of `otel-engine serve`, in one place.

Each limit bounds a resource a single unauthenticated client could otherwise take from every
other: memory (body size), event-loop and tokenizer time (prompt characters, chat messages
and their template overhead, earlier tool calls; stop strings are bounded in
`SamplingParams`), the stack (JSON nesting), file descriptors (connections) and engine slots
(requests whose client stopped reading). docs/operations.md ("Hostile clients") gives the
reasoning; the flags are in docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 4 * 1024 * 1024
# A token of any tokenizer in use covers far fewer characters than this, so a prompt with
# more characters than this many per token of context can never fit: it is refused before
# it is tokenized.
CHARS_PER_TOKEN_BOUND = 32
# A chat message costs its template's markup besides its content: at least two tokens (a
# role header and an end marker) in every template in use, so it counts this many
# characters against the same budget.
MESSAGE_OVERHEAD_CHARS = 2 * CHARS_PER_TOKEN_BOUND
# Counted on the raw body before pydantic validates a message (bodies.py).
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048  # in all the messages of a request
MAX_TOOL_CALLS = 2048  # earlier tool calls, in all the messages of a request
# Objects and arrays inside one another in a request body, and in an earlier call's decoded
# arguments: far below the interpreter's recursion limit (about 1,000 frames), which the
# encoders, templates and grammar compilers that walk a value by recursion would reach
# first; far above what a JSON Schema or a call's arguments need.
MAX_JSON_DEPTH = 64


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-server bounds; `max_prompt_chars` None means `CHARS_PER_TOKEN_BOUND` per token of
    the model's context."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_chars: int | None = None
    max_connections: int = 1024
    request_read_timeout: float = 30.0  # whole request (headers and body) after its first byte
    stream_write_timeout: float = 30.0  # a response that cannot be written this long is aborted
    keep_alive_timeout: int = 30  # idle keep-alive connections are closed after this
    send_buffer_bytes: int = 32 * 1024  # kernel send buffer per connection
    write_buffer_bytes: int = 16 * 1024  # queued in the server before writes pause
    # A stream is paused in the engine (its slot and KV blocks go to others) once this many
    # of its bytes wait unsent because the client is not reading: bytes the client's receive
    # window does not take yet, in the kernel's send queue or the server's buffer. Bytes in
    # flight on a slow network do not count.
    slow_reader_bytes: int = 2 * 1024

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN_BOUND * max_model_len
