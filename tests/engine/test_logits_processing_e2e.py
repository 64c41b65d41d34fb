"""Penalties, logit bias and min_tokens through the engine (greedy, float32, tiny model):
each changes what greedy decoding emits as its definition says, the same at TP=1 and TP=2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # starts engines

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> Iterator[LLM]:
    with LLM(tiny_model_dir, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def eos_id(tiny_model_dir: str) -> int:
    return int(json.loads((Path(tiny_model_dir) / "config.json").read_text())["eos_token_id"])


def greedy(llm: LLM, prompts: list[list[int]], **options: object) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **options)  # type: ignore[arg-type]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_logit_bias_minus_100_bans_the_token_greedy_would_emit(
    llm: LLM, tiny_prompts: list[list[int]]
) -> None:
    """Each prompt's first greedy token, banned with -100, appears nowhere in its output."""
    prompts = tiny_prompts[3:7]
    plain = greedy(llm, prompts, ignore_eos=True)

    for prompt, tokens in zip(prompts, plain, strict=True):
        [banned] = greedy(llm, [prompt], ignore_eos=True, logit_bias=((tokens[0], -100.0),))
        assert tokens[0] not in banned
        assert banned != tokens


def test_repetition_and_frequency_penalties_change_greedy_output(
    llm: LLM, tiny_prompts: list[list[int]]
) -> None:
    """A random tiny model repeats itself; penalizing repeats changes what greedy emits and
    reduces repeated tokens."""
    prompts = tiny_prompts[4:8]
    plain = greedy(llm, prompts, ignore_eos=True)
    repetition = greedy(llm, prompts, ignore_eos=True, repetition_penalty=3.0)
    frequency = greedy(llm, prompts, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)

    def repeats(outputs: list[list[int]]) -> int:
        return sum(len(t) - len(set(t)) for t in outputs)

    assert repetition != plain
    assert frequency != plain
    assert repeats(frequency) < repeats(plain)


def test_min_tokens_holds_eos_back_until_reached(
    llm: LLM, tiny_prompts: list[list[int]], eos_id: int
) -> None:
    """EOS biased to win: without min_tokens it ends the output at once; with min_tokens=5
    it cannot appear before five tokens, then ends the output."""
    prompt = tiny_prompts[5]
    bias = ((eos_id, 100.0),)

    [at_once] = greedy(llm, [prompt], logit_bias=bias)
    [held] = greedy(llm, [prompt], logit_bias=bias, min_tokens=5)

    assert [eos_id] == at_once
    assert 6 == len(held)
    assert eos_id not in held[:5]
    assert eos_id == held[5]


def test_tensor_parallel_processes_logits_the_same(
    llm: LLM, tiny_model_dir: str, tiny_prompts: list[list[int]], eos_id: int
) -> None:
    """Rank 0 samples at TP=2: penalties and biases give TP=1's greedy tokens."""
    prompts = tiny_prompts[2:8]
    options = {"ignore_eos": True, "repetition_penalty": 1.8, "frequency_penalty": 0.7}
    options["logit_bias"] = ((eos_id, 5.0), (3, -100.0))
    expected = greedy(llm, prompts, **options)

    with LLM(tiny_model_dir, dtype="float32", tensor_parallel_size=2, num_kv_blocks=256) as tp2:
        assert expected == greedy(tp2, prompts, **options)
