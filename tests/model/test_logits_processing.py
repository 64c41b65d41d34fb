"""Logits processing on the sampling rank: each penalty, bias and mask against a reference
computed here from its definition, batched rows independent of each other, and the bounds
that `SamplingParams.validate` puts on them."""

from __future__ import annotations

import pytest
import torch

from otel_engine.errors import RequestError
from otel_engine.ipc.messages import LogitsProcessing
from otel_engine.model.sampler import Sampler, process_logits
from otel_engine.sampling_params import SamplingParams

VOCAB = 32


def logits_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_frequency_and_presence_penalties_follow_openai() -> None:
    """logit[t] -= frequency * count(t in output) + presence * (count > 0); the prompt does
    not count."""
    logits = logits_of(1)
    output = [3, 3, 3, 7, 9, 9]
    proc = LogitsProcessing(
        presence_penalty=0.5, frequency_penalty=0.25, output_token_ids=output, prompt_token_ids=[1]
    )

    processed = process_logits(logits, [proc])

    expected = logits.clone()
    for token in set(output):
        expected[0, token] -= 0.25 * output.count(token) + 0.5
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)


def test_repetition_penalty_follows_hf_over_prompt_and_output() -> None:
    """A token seen in the prompt or the output: its logit divided by the penalty when
    positive, multiplied when negative; other tokens unchanged."""
    logits = logits_of(1, seed=1)
    prompt, output = [0, 1, 2], [2, 5]
    proc = LogitsProcessing(
        repetition_penalty=1.5, output_token_ids=output, prompt_token_ids=prompt
    )

    processed = process_logits(logits, [proc])

    expected = logits.clone()
    for token in {*prompt, *output}:
        value = expected[0, token]
        expected[0, token] = value / 1.5 if value > 0 else value * 1.5
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)


def test_logit_bias_adds_and_banned_tokens_cannot_win() -> None:
    """Bias is added to the logit; a banned (min_tokens) token is -inf."""
    logits = logits_of(1, seed=2)
    proc = LogitsProcessing(logit_bias=[(4, 2.5), (6, -100.0)], banned_token_ids=[11])

    processed = process_logits(logits, [proc])

    expected = logits.clone()
    expected[0, 4] += 2.5
    expected[0, 6] -= 100.0
    expected[0, 11] = float("-inf")
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)


def test_rows_are_processed_independently_and_plain_rows_are_untouched() -> None:
    """One row penalized, one biased, one without processing: each as if alone."""
    logits = logits_of(3, seed=3)
    penalized = LogitsProcessing(frequency_penalty=1.0, output_token_ids=[5, 5])
    biased = LogitsProcessing(logit_bias=[(5, 3.0)])

    batched = process_logits(logits, [penalized, None, biased])

    assert torch.equal(process_logits(logits[0:1], [penalized])[0], batched[0])
    assert torch.equal(logits[1], batched[1])
    assert torch.equal(process_logits(logits[2:3], [biased])[0], batched[2])
    assert torch.equal(logits_of(3, seed=3), logits), "the input logits are not modified"


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely() -> None:
    """With min_p 0.3 only tokens whose probability is >= 0.3 x the top one can be drawn."""
    probs = torch.tensor([[0.5, 0.2, 0.16, 0.14]])
    logits = probs.log()
    sampler = Sampler(torch.device("cpu"))
    proc = LogitsProcessing(min_p=0.3)

    drawn = {sampler(logits, [1.0], [1.0], [0], [seed], [0], [proc])[0] for seed in range(200)}

    assert {0, 1, 2} == drawn  # 0.16 >= 0.15 stays; 0.14 < 0.15 goes


def test_greedy_rows_see_the_processed_logits() -> None:
    """A ban on the argmax makes greedy take the next token."""
    logits = logits_of(1, seed=4)
    top2 = logits[0].topk(2).indices.tolist()
    sampler = Sampler(torch.device("cpu"))
    proc = LogitsProcessing(banned_token_ids=[top2[0]])

    assert [top2[1]] == sampler(logits, [0.0], [1.0], [0], [None], [0], [proc])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1000.0),
        ("min_p", 1.5),
        ("min_tokens", 17),
        ("min_tokens", -1),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((VOCAB, 1.0),)),
        ("logit_bias", ((3, float("inf")),)),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    params = SamplingParams(max_tokens=16, **{field: value})  # type: ignore[arg-type]

    with pytest.raises(RequestError) as excinfo:
        params.validate(VOCAB)

    assert field == excinfo.value.param
