"""Automatic prefix caching: greedy output is the same with the cache on and off (and equal
to transformers'), for prompts that share one block, several blocks, a block plus a partial
block, a whole prompt, and a prompt that is itself a prefix; at TP=1 and TP=2.

A first request computes a 40-token prompt; then the others run together (on a small
cache with a small step budget, so they are chunked and compete for blocks). Each shared
prompt reports how many of its tokens came from the cache, which proves the cache was used.
"""

from __future__ import annotations

from typing import Any

import pytest

from otel_engine import LLM, SamplingParams
from tests.helpers.tiny_model import hf_greedy

pytestmark = pytest.mark.slow  # starts engine processes

BLOCK = 4
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CACHE: dict[str, Any] = {"block_size": BLOCK, "num_kv_blocks": 96, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def prompts(tiny_prompts: list[list[int]]) -> dict[str, list[int]]:
    base, other = tiny_prompts[-1], tiny_prompts[-2]
    assert base[:BLOCK] != other[:BLOCK]
    return {
        "first": base[:40],
        "one_block": base[:BLOCK] + other[BLOCK : BLOCK + 26],
        "several_blocks": base[: 6 * BLOCK] + other[:10],
        "block_and_partial": base[: 5 * BLOCK + 2] + other[20:37],
        "resent": base[:40],
        "prefix_of_first": base[: 3 * BLOCK],
        "unrelated": other[:30],
    }


# Tokens each prompt finds cached after "first" ran: whole blocks only, and at least the
# last token is computed (so a resent prompt recomputes its last block).
EXPECTED_CACHED = {
    "one_block": BLOCK,
    "several_blocks": 6 * BLOCK,
    "block_and_partial": 5 * BLOCK,
    "resent": 9 * BLOCK,
    "prefix_of_first": 2 * BLOCK,
    "unrelated": 0,
}


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    outputs = hf_greedy(tiny_model_dir, list(prompts.values()), MAX_TOKENS)
    return dict(zip(prompts, outputs, strict=True))


def run(
    model_dir: str, prompts: dict[str, list[int]], *, caching: bool, tp: int
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy outputs and cached-token counts: "first" alone, then the rest at once."""
    with LLM(model_dir, tensor_parallel_size=tp, enable_prefix_caching=caching, **CACHE) as llm:
        [first] = llm.generate([prompts["first"]], GREEDY)
        later = llm.generate(list(prompts.values())[1:], GREEDY)
        rest = dict(zip(list(prompts)[1:], later, strict=True))
    outputs = {"first": first, **rest}
    tokens = {name: list(o.outputs[0].token_ids) for name, o in outputs.items()}
    cached = {name: int(o.metrics["num_cached_tokens"]) for name, o in outputs.items()}
    return tokens, cached


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_output_is_the_same_with_the_cache_on_and_off(
    tiny_model_dir: str,
    prompts: dict[str, list[int]],
    reference: dict[str, list[int]],
    tp: int,
) -> None:
    """Cache on: each shared prompt takes its expected cached tokens and its output equals
    the output without the cache and transformers' (float32, exact)."""
    on, cached_on = run(tiny_model_dir, prompts, caching=True, tp=tp)
    off, cached_off = run(tiny_model_dir, prompts, caching=False, tp=tp)

    assert {"first": 0, **EXPECTED_CACHED} == cached_on
    assert set(cached_off.values()) == {0}
    assert reference == off
    assert reference == on
