"""bench/spec_ceiling.py's replay of prompt lookup over an answer and its costings: plain,
always all the lookup proposes, the cheapest k at each position (the oracle), and free
verification. No engine is started."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def ceiling(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("spec_ceiling")


def test_the_replay_proposes_what_followed_the_last_match_and_counts_its_agreement(
    ceiling: ModuleType,
) -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    answer = [9, 1, 2, 3, 4, 7]  # copies the prompt from 1 on, then leaves it

    positions = ceiling.replay(prompt, answer, 2, 4, 8)

    # Decode position p has the prompt and answer[:p]. At 1 and 2 the last tokens (6 9,
    # 9 1) match nothing; at 3 "1 2" matches the prompt's start and proposes the 7 tokens
    # after it (3 4 5 6 9 1 2), of which the answer gives 3 4; at 4 "1 2 3", and at 5
    # "1 2 3 4", propose the 7 after them, of which the answer gives 4, then none.
    assert positions == [(0, 0), (0, 0), (7, 2), (7, 1), (7, 0)]


def test_costings_of_an_answer(ceiling: ModuleType) -> None:
    """Steps of k proposals cost `cost[k]`; an answer of 6 decode positions where the
    lookup proposes 4 at position 0, all matching, then nothing."""
    positions = [(4, 4), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0)]
    cost = [1.0, 1.1, 1.2, 1.5, 3.0]

    seconds = ceiling.decode_seconds(positions, cost)

    assert seconds["plain"] == 6.0
    assert seconds["K"] == 3.0 + 1.0  # 4 proposals: 5 tokens in a step, then one plain
    assert seconds["oracle"] == pytest.approx(1.5 + 2.0)  # 3 of them (1.5) beat 4 (3.0)
    assert seconds["free"] == 2.0
    assert ceiling.tokens_per_step(positions) == 3.0  # 6 tokens in 2 steps


def test_the_oracle_is_never_worse_than_plain_or_always_verifying(ceiling: ModuleType) -> None:
    positions = [(3, 0), (3, 1), (2, 2), (0, 0), (4, 3), (1, 1), (0, 0)]
    cost = [1.0, 1.4, 1.5, 1.9, 2.6]

    seconds = ceiling.decode_seconds(positions, cost)

    assert seconds["free"] <= seconds["oracle"] <= min(seconds["plain"], seconds["K"])
