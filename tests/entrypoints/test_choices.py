"""`n` and `best_of` over HTTP with the official client: independent samples of one prompt,
reproducible with a seed, usage counting every sample, the prompt's full blocks computed
once (the other samples find them in the prefix cache), streamed choices by index."""

from __future__ import annotations

import pytest

from otel_engine.engine.choices import sample_seed
from tests.entrypoints.conftest import Served

pytestmark = pytest.mark.slow  # starts engine processes

PROMPT = "Once upon a time there was a small town by the sea, and in the town"
HOT = {"temperature": 1.5, "max_tokens": 8, "extra_body": {"ignore_eos": True}}


def test_n_samples_are_independent_and_reproducible_with_a_seed(served: Served) -> None:
    """n=4 with a seed: 4 choices indexed 0..3, not all alike, the same texts on a second
    call; usage counts the tokens of all four."""
    client = served.openai()

    def texts() -> list[str]:
        completion = client.completions.create(
            model=served.model, prompt=PROMPT, n=4, seed=11, **HOT
        )
        assert [0, 1, 2, 3] == [c.index for c in completion.choices]
        assert completion.usage is not None
        assert 32 == completion.usage.completion_tokens
        return [c.text for c in completion.choices]

    first = texts()

    assert first == texts()
    assert len(set(first)) > 1


def test_samples_share_the_prompt_through_the_prefix_cache(served: Served) -> None:
    """The first sample computes the prompt; the other three find its full blocks."""
    hits = served.metric("otel_engine_prefix_cache_hits_total")
    prompt = list(range(100, 170))  # 70 tokens: four full 16-token blocks
    served.openai().completions.create(model=served.model, prompt=prompt, n=4, **HOT)

    assert served.metric("otel_engine_prefix_cache_hits_total") - hits >= 3 * 64


def test_best_of_returns_the_most_likely_sample(served: Served) -> None:
    """best_of=4, n=1 returns the sample of highest cumulative logprob among the four that
    n=4 with the same seed draws."""
    client = served.openai()
    samples = client.completions.create(
        model=served.model, prompt=PROMPT, n=4, seed=5, logprobs=0, **HOT
    )
    best = client.completions.create(
        model=served.model, prompt=PROMPT, n=1, best_of=4, seed=5, **HOT
    )

    def total(choice: object) -> float:
        return sum(choice.logprobs.token_logprobs)  # type: ignore[attr-defined]

    expected = max(samples.choices, key=total)
    assert [expected.text] == [c.text for c in best.choices]
    assert best.choices[0].logprobs is None  # the client did not ask for them
    assert best.usage is not None
    assert 32 == best.usage.completion_tokens


def test_streamed_chat_choices_arrive_by_index(served: Served) -> None:
    """n=3 streamed: every chunk names its choice; each choice ends once; the texts equal
    the non-streamed ones for the same seed."""
    client = served.openai()
    options = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 9, **HOT}
    full = client.chat.completions.create(model=served.model, **options)
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    ends: list[int] = []
    for chunk in client.chat.completions.create(model=served.model, stream=True, **options):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                ends.append(choice.index)

    assert [0, 1, 2] == sorted(ends)
    assert [c.message.content for c in full.choices] == [texts[i] for i in range(3)]


def test_sample_seeds_are_distinct_and_stay_in_64_bits() -> None:
    seeds = [sample_seed(2**63 - 1, i) for i in range(16)]

    assert len(set(seeds)) == 16
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert 2**63 - 1 == seeds[0]
