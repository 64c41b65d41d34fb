"""Every model family through the HTTP server with the official client: greedy completions
equal transformers' tokens, and a chat answer streams."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_engine import AsyncLLM
from otel_engine.entrypoints.api_server import make_server
from tests.entrypoints.conftest import Served, ServerLoop
from tests.helpers.tiny_model import FAMILY_CONFIGS, hf_greedy, write_tiny_family

pytestmark = pytest.mark.slow  # starts engine processes

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(FAMILY_CONFIGS))
def family_served(
    request: pytest.FixtureRequest,
    server_loop: ServerLoop,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Served, str]]:
    model_dir = write_tiny_family(tmp_path_factory.mktemp(f"api-{request.param}"), request.param)
    engine = AsyncLLM(model=model_dir, dtype="float32", tensor_parallel_size=2, num_kv_blocks=256)
    server = make_server(engine, drain_timeout=5)
    yield Served(server_loop.start(server), engine, server), model_dir
    server_loop.stop(server)
    engine.shutdown()


def test_completions_equal_transformers_and_chat_streams(
    family_served: tuple[Served, str], tiny_prompts: list[list[int]]
) -> None:
    served, model_dir = family_served
    client = served.openai()
    prompts = tiny_prompts[:3]
    texts, counts = [], []
    for prompt in prompts:
        completion = client.completions.create(
            model=served.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        texts.append(completion.choices[0].text)
        assert completion.usage is not None
        counts.append(completion.usage.completion_tokens)
    stream = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
    )
    chunks = list(stream)

    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    tokenizer = served.engine.tokenizer
    assert counts == [MAX_TOKENS] * len(prompts)
    # a character the last token only starts is not in the text (it never completed)
    assert texts == [tokenizer.decode(tokens).rstrip("\ufffd") for tokens in expected]
