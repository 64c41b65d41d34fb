"""OpenAI-compatible generation over HTTP with the real `openai` client and the tiny model."""

from __future__ import annotations

import asyncio
import json

from tests.entrypoints.conftest import Served

PROMPT = "The engine schedules requests in steps."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_completion_stream_equals_non_stream(served: Served) -> None:
    """At temperature 0 the streamed deltas concatenate to the non-streamed text."""
    client = served.openai()
    full = client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=24, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=served.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
    )

    assert full.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert full.choices[0].text != ""


def test_completion_response_shape(served: Served) -> None:
    """A completion has a cmpl- id, the served model name and consistent usage."""
    result = served.openai().completions.create(
        model=served.model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    assert result.id.startswith("cmpl-")
    assert "text_completion" == result.object
    assert served.model == result.model
    assert 5 == result.usage.completion_tokens
    assert "length" == result.choices[0].finish_reason
    assert result.usage.prompt_tokens + 5 == result.usage.total_tokens


def test_completion_default_max_tokens_is_16(served: Served) -> None:
    """Without max_tokens a completion stops after 16 tokens, like OpenAI's default."""
    result = served.openai().completions.create(
        model=served.model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )

    assert 16 == result.usage.completion_tokens


def test_completion_accepts_token_ids(served: Served) -> None:
    """A prompt of token ids, bare or in a one-element list, gives the same text as the string."""
    client = served.openai()
    ids = served.engine.encode(PROMPT)
    by_text = client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=8, temperature=0
    )
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=8, temperature=0)
    by_list = client.completions.create(
        model=served.model, prompt=[ids], max_tokens=8, temperature=0
    )

    assert by_text.choices[0].text == by_ids.choices[0].text == by_list.choices[0].text


def test_chat_stream_equals_non_stream(served: Served) -> None:
    """Chat: the role chunk, then content deltas that concatenate to the full message."""
    client = served.openai()
    full = client.chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=24, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=served.model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True
        )
    )

    assert "assistant" == chunks[0].choices[0].delta.role
    assert full.choices[0].message.content == "".join(
        c.choices[0].delta.content or "" for c in chunks
    )
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert full.id.startswith("chatcmpl-")
    assert "chat.completion" == full.object
    assert "chat.completion.chunk" == chunks[0].object


def test_chat_applies_template_without_extra_bos(served: Served) -> None:
    """Chat prompt tokens are the chat template's text encoded without added special tokens."""
    template = served.engine.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    expected = len(served.engine.encode(template, add_special_tokens=False))

    result = served.openai().chat.completions.create(
        model=served.model, messages=MESSAGES, max_tokens=2, temperature=0
    )

    assert expected == result.usage.prompt_tokens


def test_chat_max_completion_tokens(served: Served) -> None:
    """max_completion_tokens bounds the chat completion (and wins over max_tokens)."""
    result = served.openai().chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        max_completion_tokens=3,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    assert 3 == result.usage.completion_tokens


def test_stream_include_usage(served: Served) -> None:
    """include_usage adds a last chunk with usage and no choices; other chunks have null usage."""
    chunks = list(
        served.openai().chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )

    assert [] == chunks[-1].choices
    assert 6 == chunks[-1].usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(served: Served) -> None:
    """The raw stream is `data: {json}` events ending with `data: [DONE]`."""
    body = {"model": served.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with served.http() as client, client.stream("POST", "/v1/completions", json=body) as resp:
        events = [line for line in resp.iter_lines() if line]
        content_type = resp.headers["content-type"]

    assert content_type.startswith("text/event-stream")
    assert "data: [DONE]" == events[-1]
    assert all(e.startswith("data: ") for e in events)
    assert all("choices" in json.loads(e[6:]) for e in events[:-1])


def test_stop_string_ends_completion(served: Served) -> None:
    """A stop string taken from the greedy output cuts the text before it, reason 'stop'."""
    client = served.openai()
    kwargs = {
        "model": served.model,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 :][:3]

    result = client.completions.create(stop=[stop], **kwargs)

    assert text[: text.index(stop)] == result.choices[0].text
    assert "stop" == result.choices[0].finish_reason


def test_same_seed_same_text(served: Served) -> None:
    """At temperature 1.0 two requests with the same seed give the same text."""
    client = served.openai()

    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=served.model, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)


def test_models_lists_served_model(served: Served) -> None:
    """GET /v1/models lists exactly the served model."""
    models = served.openai().models.list()

    assert [served.model] == [m.id for m in models.data]


def test_models_lists_the_sampling_defaults_in_force(served: Served) -> None:
    """What a request that omits sampling fields gets: the engine's resolved defaults."""
    with served.http() as client:
        [card] = client.get("/v1/models").json()["data"]

    assert served.engine.generation_defaults.values == card["sampling_defaults"]


def test_health_ok(served: Served) -> None:
    """GET /health answers 200 while the engine serves."""
    with served.http() as client:
        assert 200 == client.get("/health").status_code


def test_64_concurrent_streams_complete(served: Served) -> None:
    """64 concurrent streaming requests all finish with the requested number of tokens."""

    async def one(client: object, index: int) -> int:
        stream = await client.completions.create(  # type: ignore[attr-defined]
            model=served.model,
            prompt=f"{PROMPT} {index}",
            max_tokens=12,
            temperature=0.7,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens if usage else -1

    async def main() -> list[int]:
        async with served.async_openai() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert [12] * 64 == asyncio.run(main())


def test_metrics_count_requests_and_tokens(served: Served) -> None:
    """A finished request moves the success, prompt-token and generation-token counters."""
    before_ok = served.metric("otel_engine_request_success_total", finish_reason="length")
    before_gen = served.metric("otel_engine_generation_tokens_total")
    before_prompt = served.metric("otel_engine_prompt_tokens_total")

    result = served.openai().completions.create(
        model=served.model, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True}
    )

    assert before_ok + 1 == served.metric(
        "otel_engine_request_success_total", finish_reason="length"
    )
    assert before_gen + 7 == served.metric("otel_engine_generation_tokens_total")
    assert before_prompt + result.usage.prompt_tokens == served.metric(
        "otel_engine_prompt_tokens_total"
    )
