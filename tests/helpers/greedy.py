"""Greedy generation with each token's top-5 log-probs, for tests that compare two paths'
tokens except at near ties (where the two top log-probs are closer than the paths differ)."""

from __future__ import annotations

from typing import Any

from otel_engine import SamplingParams


def greedy_with_tops(
    llm: Any, prompts: list[list[int]], max_tokens: int = 16
) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Each prompt's greedy token ids, and every generated position's top-5 log-probs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    outputs = [o.outputs[0] for o in llm.generate([list(p) for p in prompts], params)]
    tops = []
    for output in outputs:
        assert output.logprobs is not None
        tops += [dict(zip(p.top_token_ids, p.top_logprobs, strict=True)) for p in output.logprobs]
    return [list(o.token_ids) for o in outputs], tops
