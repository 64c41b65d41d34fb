"""The sampler: greedy rows, temperature, top-k, top-p, and per-request seeds that do not
depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from otel_engine.model.sampler import Sampler

VOCAB = 64


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"))


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sample(
    sampler: Sampler,
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seeds: list[int | None] | None = None,
    positions: list[int] | None = None,
) -> list[int]:
    rows = logits.shape[0]
    return sampler(
        logits,
        [temperature] * rows,
        [top_p] * rows,
        [top_k] * rows,
        seeds if seeds is not None else [None] * rows,
        positions if positions is not None else [0] * rows,
    )


def test_temperature_zero_is_argmax(sampler: Sampler) -> None:
    """Greedy rows pick the highest logit."""
    logits = random_logits(8)

    assert logits.argmax(dim=-1).tolist() == sample(sampler, logits, temperature=0.0)


def test_top_k_one_is_argmax(sampler: Sampler) -> None:
    """top_k=1 leaves only the best token, whatever the temperature and seed."""
    logits = random_logits(8)

    result = sample(sampler, logits, temperature=1.5, top_k=1, seeds=list(range(8)))

    assert logits.argmax(dim=-1).tolist() == result


def test_tiny_top_p_is_argmax(sampler: Sampler) -> None:
    """A nucleus smaller than the top token's mass keeps only that token."""
    logits = random_logits(8)

    assert logits.argmax(dim=-1).tolist() == sample(sampler, logits, top_p=1e-6)


def test_greedy_rows_stay_greedy_in_a_mixed_batch(sampler: Sampler) -> None:
    """Rows with temperature 0 return argmax even when their neighbours sample."""
    logits = random_logits(6)
    temperatures = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]

    result = sampler(logits, temperatures, [1.0] * 6, [0] * 6, [None] * 6, [0] * 6)

    argmax = logits.argmax(dim=-1).tolist()
    assert argmax[0::2] == result[0::2]


def test_samples_stay_inside_top_k(sampler: Sampler) -> None:
    """With top_k=5 every draw is one of the five best tokens."""
    logits = torch.zeros(500, VOCAB) + random_logits(1)
    allowed = set(logits[0].topk(5).indices.tolist())

    result = sample(sampler, logits, top_k=5, seeds=list(range(500)))

    assert set(result) <= allowed
    assert len(set(result)) > 1


def test_samples_stay_inside_top_p(sampler: Sampler) -> None:
    """With top_p=0.5 on probabilities 0.4/0.3/0.2/0.1, only the first two tokens appear."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(400, 1)

    result = sample(sampler, logits, top_p=0.5, seeds=list(range(400)))

    assert {0, 1} == set(result)


def test_sampling_follows_the_distribution(sampler: Sampler) -> None:
    """Token 0 with probability 0.7 is drawn about 70% of the time over 4,000 seeds."""
    logits = torch.tensor([math.log(0.7), math.log(0.3)]).repeat(4000, 1)

    result = sample(sampler, logits, seeds=list(range(4000)))

    assert 0.66 < result.count(0) / 4000 < 0.74


def test_temperature_sharpens_the_distribution(sampler: Sampler) -> None:
    """A low temperature draws the likelier token more often than temperature 1."""
    logits = torch.tensor([math.log(0.6), math.log(0.4)]).repeat(2000, 1)
    seeds: list[int | None] = list(range(2000))

    plain = sample(sampler, logits, temperature=1.0, seeds=seeds).count(0)
    sharp = sample(sampler, logits, temperature=0.3, seeds=seeds).count(0)

    assert sharp > plain + 300


def test_same_seed_same_token_whatever_the_batch(sampler: Sampler) -> None:
    """A seeded row draws the same token alone or at another index of a bigger batch."""
    row = torch.zeros(1, VOCAB)
    others = random_logits(5, seed=3)

    alone = sample(sampler, row, seeds=[1234], positions=[7])
    batch = torch.cat([others[:2], row, others[2:]])
    together = sample(
        sampler, batch, seeds=[None, 5, 1234, None, 9, 11], positions=[0, 0, 7, 0, 0, 0]
    )

    assert alone[0] == together[2]


def test_seeded_draws_vary_with_output_position(sampler: Sampler) -> None:
    """One seed gives different noise at different output positions (not one fixed token)."""
    logits = torch.zeros(32, VOCAB)

    result = sample(sampler, logits, seeds=[42] * 32, positions=list(range(32)))

    assert len(set(result)) > 8


def test_different_seeds_draw_differently(sampler: Sampler) -> None:
    """Uniform logits under 32 different seeds give many different tokens."""
    logits = torch.zeros(32, VOCAB)

    result = sample(sampler, logits, seeds=list(range(32)))

    assert len(set(result)) > 8


@pytest.mark.parametrize("top_p", [1e-50, 5e-324])
def test_top_p_float32_rounds_to_zero_keeps_the_best_token(sampler: Sampler, top_p: float) -> None:
    """A top_p below float32's range (0 on the tensor) still keeps the most likely token:
    it is drawn, not token 0 from an all -inf row."""
    logits = random_logits(8)

    assert logits.argmax(dim=-1).tolist() == sample(sampler, logits, top_p=top_p)


def test_top_k_past_the_vocabulary_is_no_filter(sampler: Sampler) -> None:
    """A top_k larger than the vocabulary keeps every token (same draws as top_k=0)."""
    logits = random_logits(16)
    seeds: list[int | None] = list(range(16))

    assert sample(sampler, logits, seeds=seeds) == sample(
        sampler, logits, top_k=VOCAB * 4, seeds=seeds
    )
