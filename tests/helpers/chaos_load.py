"""The chaos drill's clients: a fixed pool of request bodies of every kind, and the client
loop that sends them and records what it got (`ledger.Sent`).

Every body is deterministic (greedy, or sampled with a seed), so a fault-free server gives
each one output, whatever the batch: the drill sends each body many times under faults and
once more to a fault-free server, and every completed answer must equal that one.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import secrets
from typing import Any

import httpx

from tests.helpers.ledger import Sent, traceparent

CORPUS = (
    "The engine restarts in place and every stream goes on.",
    "A pause in the stream, not an error.",
    "Tokens already sent are computed again, never sent again.",
    "Every request ends in exactly one record in each of its sources.",
    "When a worker process dies, the engine core notices within a second.",
    "A poison request fails alone while the others finish.",
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "The weather forecast of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"line": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["line", "count"],
}
POISON_WORD = "poison "
SLOW_READ_S = 0.05  # a slow reader's pause before each line it reads
CLIENT_TIMEOUT_S = 180.0


class RequestKind(enum.StrEnum):
    """What a chaos client sends (each streamed but `FULL`)."""

    GREEDY = "greedy"
    SEEDED = "seeded"
    LOGPROBS = "logprobs"
    N2 = "n2"
    JSON_SCHEMA = "json_schema"
    TOOLS = "tools"
    FULL = "full"  # not streamed
    SLOW_READER = "slow_reader"
    ABORT = "abort"  # the client hangs up after a few chunks
    POISON = "poison"  # its prompt makes the engine fail at every step that schedules it

    @property
    def is_compared(self) -> bool:
        """Whether a completed answer must equal the fault-free one."""
        return self not in (RequestKind.ABORT, RequestKind.POISON)


CLIENT_KINDS = [kind for kind in RequestKind if kind is not RequestKind.POISON]


def body_pool(seed: int, num_per_kind: int, poison_words: int) -> list[tuple[RequestKind, Any]]:
    """`num_per_kind` bodies of each kind (the poison's prompt is `poison_words` words, longer
    than every other prompt), the same for the same seed."""
    rng = random.Random(seed)
    pool: list[tuple[RequestKind, Any]] = []
    for kind in RequestKind:
        for index in range(1 if kind is RequestKind.POISON else num_per_kind):
            prompt = " ".join(rng.sample(CORPUS, 2))
            body: dict[str, Any] = {
                "prompt": prompt,
                "max_tokens": rng.randrange(16, 64),
                "ignore_eos": True,
                "temperature": 0,
            }
            if kind in (RequestKind.SEEDED, RequestKind.FULL):
                body.update(temperature=0.9, seed=rng.randrange(1000))
            elif kind is RequestKind.LOGPROBS:
                body["logprobs"] = 2
            elif kind is RequestKind.N2:
                body.update(n=2, temperature=0.8, seed=rng.randrange(1000))
            elif kind in (RequestKind.JSON_SCHEMA, RequestKind.TOOLS):
                del body["prompt"]
                body.update(
                    messages=[{"role": "user", "content": prompt}],
                    temperature=0.6,
                    seed=rng.randrange(1000),
                )
                if kind is RequestKind.TOOLS:
                    body.update(tools=TOOLS, tool_choice="required")
                else:
                    body["response_format"] = {
                        "type": "json_schema",
                        "json_schema": {"name": f"answer{index}", "schema": SCHEMA},
                    }
            elif kind is RequestKind.POISON:
                body.update(prompt=POISON_WORD * poison_words, max_tokens=8)
            if kind is not RequestKind.FULL:
                body.update(stream=True, stream_options={"include_usage": True})
            pool.append((kind, body))
    return pool


def _path(body: dict[str, Any]) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _add_choice(sent: Sent, choice: dict[str, Any]) -> None:
    """One choice of a chunk (or of a whole response) into `sent`: its text (content, or
    tool calls as `name(arguments)` without their random ids), reason, logprob tokens."""
    index = choice["index"]
    part = choice.get("delta") or choice.get("message") or {}
    text = choice.get("text") if "text" in choice else part.get("content")
    calls = "".join(
        f"{(call.get('function') or {}).get('name') or ''}"
        f"{(call.get('function') or {}).get('arguments') or ''}"
        for call in part.get("tool_calls") or ()
    )
    sent.texts[index] = sent.texts.get(index, "") + (text or "") + calls
    sent.reasons[index] = choice.get("finish_reason") or sent.reasons.get(index)
    if choice.get("logprobs"):
        logprobs = choice["logprobs"]
        tokens = logprobs.get("tokens") or [e["token"] for e in logprobs.get("content") or ()]
        sent.tokens.setdefault(index, []).extend(tokens)


def _usage(usage: dict[str, Any] | None) -> dict[str, int] | None:
    """The token counts (prefix cache hits depend on arrival order: left out)."""
    if usage is None:
        return None
    return {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


async def _read_stream(response: httpx.Response, sent: Sent, hang_up_after: int | None) -> None:
    num_chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if sent.kind == RequestKind.SLOW_READER:
            await asyncio.sleep(SLOW_READ_S)
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            sent.error = event["error"]
            continue
        sent.response_id = sent.response_id or event.get("id")
        sent.usage = _usage(event.get("usage")) or sent.usage
        for choice in event.get("choices", []):
            _add_choice(sent, choice)
        num_chunks += 1
        if hang_up_after is not None and num_chunks >= hang_up_after:
            sent.is_aborted = True
            return  # leaving the `stream` block closes the connection


async def send(
    client: httpx.AsyncClient,
    body: dict[str, Any],
    sent: Sent,
    hang_up_after: int | None = None,
) -> None:
    """Send `body` under `sent.trace_id` and record the answer in `sent` (a connection that
    fails after the request went out, or a deadline passed, is `lost`)."""
    headers = {"traceparent": traceparent(sent.trace_id)}
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            if not sent.is_stream:
                response = await client.post(_path(body), json=body, headers=headers)
                sent.status = response.status_code
                payload = response.json()
                if response.status_code != 200:
                    sent.error = payload.get("error")
                    return
                sent.response_id = payload.get("id")
                sent.usage = _usage(payload.get("usage"))
                for choice in payload["choices"]:
                    _add_choice(sent, choice)
                return
            async with client.stream("POST", _path(body), json=body, headers=headers) as response:
                sent.status = response.status_code
                if response.status_code != 200:
                    sent.error = json.loads(await response.aread()).get("error")
                    return
                await _read_stream(response, sent, hang_up_after)
    except TimeoutError:
        sent.lost = f"no answer in {CLIENT_TIMEOUT_S:.0f} s"
    except httpx.HTTPError as error:
        sent.lost = f"{type(error).__name__}: {error}"


def new_trace_id() -> str:
    """A trace id no other request of any run has (the ledger's key of a request)."""
    return secrets.token_hex(16)
