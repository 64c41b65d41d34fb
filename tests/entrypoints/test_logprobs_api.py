"""Logprobs over HTTP with the official client: completions (`logprobs: k`) and chat
(`logprobs`, `top_logprobs`), streamed and not; the values are the engine's, the shapes are
OpenAI's, and streamed chunks carry the logprobs of the tokens they carry."""

from __future__ import annotations

import math

import openai
import pytest

from tests.entrypoints.conftest import Served

pytestmark = pytest.mark.slow  # starts engine processes

PROMPT = "Once upon a time there was"
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_completion_logprobs_have_openai_shape(served: Served) -> None:
    """tokens, token_logprobs, k top alternatives (the chosen one included) and text
    offsets that index the text."""
    client = served.openai()
    completion = client.completions.create(model=served.model, prompt=PROMPT, logprobs=3, **GREEDY)
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None
    tokens = logprobs.tokens or []

    assert (
        6 == len(tokens) == len(logprobs.token_logprobs or []) == len(logprobs.top_logprobs or [])
    )
    assert "".join(tokens) == choice.text
    assert [sum(len(t) for t in tokens[:i]) for i in range(6)] == logprobs.text_offset
    for token, value, top in zip(
        tokens, logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True
    ):
        assert value <= 0
        assert token in top
        assert 1 <= len(top) <= 4  # tokens that decode alike share a key
        assert max(top.values()) == pytest.approx(value)  # greedy takes the most likely


def test_chat_logprobs_have_openai_shape(served: Served) -> None:
    client = served.openai()
    chat = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None

    assert 6 == len(content)
    text = b"".join(bytes(entry.bytes or []) for entry in content)
    message = (chat.choices[0].message.content or "").encode()
    assert text.startswith(message)  # the text holds back a character its last token starts
    assert len(text) - len(message) < 4
    for entry in content:
        if "\ufffd" not in entry.token:  # a token that is not part of a character
            assert bytes(entry.bytes or []).decode() == entry.token
        assert 2 == len(entry.top_logprobs)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_carry_the_logprobs_of_their_tokens(served: Served, chat: bool) -> None:
    """Streamed and non-streamed greedy requests report the same tokens and values."""
    client = served.openai()
    if chat:
        options = {
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 1,
        }
        full = client.chat.completions.create(model=served.model, **options, **GREEDY)
        expected = [(e.token, e.logprob) for e in full.choices[0].logprobs.content]  # type: ignore[union-attr]
        stream = client.chat.completions.create(
            model=served.model, stream=True, **options, **GREEDY
        )
        got = [
            (e.token, e.logprob)
            for chunk in stream
            if chunk.choices and chunk.choices[0].logprobs is not None
            for e in chunk.choices[0].logprobs.content or []
        ]
    else:
        full = client.completions.create(model=served.model, prompt=PROMPT, logprobs=1, **GREEDY)
        lp = full.choices[0].logprobs
        assert lp is not None
        expected = list(zip(lp.tokens or [], lp.token_logprobs or [], strict=True))
        offsets = lp.text_offset
        stream = client.completions.create(
            model=served.model, prompt=PROMPT, logprobs=1, stream=True, **GREEDY
        )
        got, streamed_offsets = [], []
        for chunk in stream:
            part = chunk.choices[0].logprobs if chunk.choices else None
            if part is not None:
                got += list(zip(part.tokens or [], part.token_logprobs or [], strict=True))
                streamed_offsets += part.text_offset or []
        assert offsets == streamed_offsets

    assert [t for t, _ in expected] == [t for t, _ in got]
    assert [v for _, v in expected] == pytest.approx([v for _, v in got], abs=1e-5)
    assert all(math.isfinite(v) for _, v in got)


@pytest.mark.parametrize(
    ("endpoint", "options", "param"),
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_out_of_range_logprobs_are_400(
    served: Served, endpoint: str, options: dict[str, object], param: str
) -> None:
    client = served.openai()
    if endpoint == "chat":
        create, body = (
            client.chat.completions.create,
            {"messages": [{"role": "user", "content": "hi"}]},
        )
    else:
        create, body = client.completions.create, {"prompt": "hi"}

    with pytest.raises(openai.BadRequestError) as excinfo:
        create(model=served.model, **body, **options)

    assert param == excinfo.value.body["param"]  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(served: Served, stream: bool) -> None:
    """The loglikelihood request of evaluation harnesses: max_tokens 1, echo, logprobs 1,
    temperature 0. The text starts with the prompt; the prompt's first token has no
    logprob, every other token has one; offsets index the echoed text."""
    client = served.openai()
    options = {"prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0.0}
    num_prompt = len(served.engine.encode(PROMPT))
    if stream:
        text, tokens, values, offsets = "", [], [], []
        for chunk in client.completions.create(model=served.model, stream=True, **options):
            for choice in chunk.choices:
                text += choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    values += choice.logprobs.token_logprobs or []
                    offsets += choice.logprobs.text_offset or []
    else:
        choice = client.completions.create(model=served.model, **options).choices[0]
        assert choice.logprobs is not None
        text, tokens = choice.text, choice.logprobs.tokens or []
        values, offsets = choice.logprobs.token_logprobs or [], choice.logprobs.text_offset or []

    assert text.startswith(PROMPT)
    assert num_prompt + 1 == len(tokens) == len(values) == len(offsets)
    assert values[0] is None
    assert all(v is not None and v <= 0 for v in values[1:])
    assert offsets == sorted(offsets)
    assert offsets[-1] == len(PROMPT)  # the generated token starts right after the prompt


def test_echo_without_logprobs_returns_the_prompt_first(served: Served) -> None:
    choice = (
        served.openai()
        .completions.create(
            model=served.model, prompt=PROMPT, max_tokens=3, echo=True, temperature=0.0
        )
        .choices[0]
    )

    assert choice.text.startswith(PROMPT)
    assert choice.logprobs is None
