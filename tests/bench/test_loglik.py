"""bench/loglik.py's pure parts: which Markdown paragraphs are scored, how they become
fixed-length texts, and the distance between two engines' scores. Nothing is run."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROSE = "An English sentence long enough to be kept as a paragraph of prose by the selection."


@pytest.fixture
def loglik(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/loglik.py, imported as the scripts import each other."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("loglik")


def test_prose_paragraphs_skip_code_headings_tables_and_short_lines(loglik: ModuleType) -> None:
    lines = ["# A heading", "", PROSE, "continued.", "", "```", PROSE, "```", ""]
    markdown = "\n".join([*lines, f"| {PROSE} |", "", "Too short.", "", PROSE])
    assert [f"{PROSE} continued.", PROSE] == loglik.prose_paragraphs(markdown)


def test_chunks_are_exactly_the_length_and_drop_the_remainder(loglik: ModuleType) -> None:
    assert [[1, 2, 3], [4, 5, 6]] == loglik.chunk_tokens([[1, 2], [3, 4, 5], [6, 7]], 3)


def test_round_robin_takes_each_group_in_turn(loglik: ModuleType) -> None:
    groups = [[[1], [2], [3]], [], [[10]]]
    assert [[1], [10], [2]] == loglik.round_robin(groups, 3)


def test_compare_reports_signed_mean_max_and_agreement(loglik: ModuleType) -> None:
    reference = loglik.Scores(logprobs=[[-1.0, -2.0], [-3.0]], top1=[[5, 6], [7]])
    engine = loglik.Scores(logprobs=[[-1.5, -1.0], [-3.0]], top1=[[5, 0], [7]])
    stats = loglik.compare(reference, engine)
    assert pytest.approx(0.5) == stats["mean_abs_delta"]
    assert pytest.approx(0.5 / 3) == stats["mean_loglik_delta"]
    assert pytest.approx(1.0) == stats["max_abs_delta"]
    assert pytest.approx(2 / 3) == stats["top1_agreement"]
    assert 3 == stats["num_tokens"]
