"""bench/speculative.py's groups: each baseline's server runs together with the servers of
the methods compared with it, the baseline first, so that each set and level is measured on
them in turn. No server is started."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def speculative(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("speculative")


def _groups(module: ModuleType, *argv: str) -> list[list[str]]:
    configs = module.build_configs(module.parse_args(["--speculative-model", "d.gguf", *argv]))
    return [[config.name for config in group] for group in module.groups(configs)]


def test_each_baseline_runs_with_the_methods_compared_with_it(speculative: ModuleType) -> None:
    assert _groups(speculative) == [["off", "ngram"], ["off-target", "draft"]]
    both = ["--methods", "off,ngram,draft,vllm-off,vllm-ngram", "--vllm-python", "python"]
    assert _groups(speculative, *both)[-1] == ["vllm-off", "vllm-ngram"]


def test_a_draft_on_the_served_model_shares_off_with_ngram(speculative: ModuleType) -> None:
    assert _groups(speculative, "--target-args", "") == [["off", "ngram", "draft"]]


def test_a_method_whose_baseline_is_not_run_runs_alone(speculative: ModuleType) -> None:
    assert _groups(speculative, "--methods", "ngram,draft") == [["ngram"], ["draft"]]


def test_a_group_whose_servers_fail_reports_each_and_leaves_none_running(
    speculative: ModuleType,
) -> None:
    """Servers that exit at start (a flag the engine refuses): each run says why, measures
    nothing, and every server of the group is stopped."""
    flags = "--methods off,ngram --streams 1 --sets quoting --prompts-per-set 1"
    args = speculative.parse_args(
        ["--server-args", "--max-num-seqs 0", "--startup-timeout", "120", *flags.split()]
    )
    (group,) = speculative.groups(speculative.build_configs(args))

    runs = speculative.run_group(args, group)

    assert list(runs) == ["off", "ngram"]
    for run in runs.values():
        assert "error" in run
        assert run["levels"] == []
        assert run["shutdown"]["killed_leftovers"] == []


def _level(repeat: int, tok_s: float, **extra: object) -> dict[str, object]:
    return {
        "set": "quoting",
        "streams": 16,
        "repeat": repeat,
        "num_requests": 16,
        "num_errors": 0,
        "output_tokens": 2000,
        "tok_s": tok_s,
        "ttft_median_ms": 100.0 + repeat,
        "tpot_median_ms": 20.0,
        "cpu_cores": {"other": 0.0},
        **extra,
    }


def test_rounds_are_summarized_by_their_medians_and_the_speed_ups_range(
    speculative: ModuleType,
) -> None:
    """--repeats: a set and level's rounds make one row: medians of the rates, the median of
    the rounds' speed-ups over their own round's baseline and their range, the acceptance of
    all their proposals, their differing requests together."""
    check = {"against": "off", "num_compared": 16}
    rounds = [(300.0, 1.10, 100, 80, 0), (330.0, 0.95, 50, 10, 1), (320.0, 1.02, 0, 0, 0)]
    levels = [
        _level(
            index,
            tok_s,
            speed_up=speed_up,
            proposed=proposed,
            accepted=accepted,
            exactness=check | {"num_differing": differing},
        )
        for index, (tok_s, speed_up, proposed, accepted, differing) in enumerate(rounds)
    ]

    (row,) = speculative.summarize(levels)

    assert row["rounds"] == 3
    assert row["tok_s"] == 320.0
    assert row["ttft_median_ms"] == 101.0
    assert row["speed_up"] == 1.02
    assert row["speed_up_range"] == [0.95, 1.10]
    assert (row["proposed"], row["accepted"], row["acceptance"]) == (150, 90, 0.6)
    assert row["exactness"] == {"against": "off", "num_compared": 48, "num_differing": 1}
    assert row["num_requests"] == 48
    assert not row["is_contended"]


def test_a_baseline_round_is_checked_against_its_first_round(speculative: ModuleType) -> None:
    """A baseline's later rounds at the first level are compared with its first round (what
    running again changes), the first with nothing; a method's round with its baseline's
    round."""
    records = [{"text": "a"}]
    runs = {
        "off": {
            "levels": [
                _level(0, 300.0, num_prompts=1, records=records),
                _level(1, 310.0, num_prompts=1, records=[{"text": "b"}]),
            ]
        },
        "ngram": {
            "levels": [
                _level(0, 330.0, num_prompts=1, records=records),
                _level(1, 310.0, num_prompts=1, records=[{"text": "b"}]),
            ]
        },
    }
    configs = speculative.build_configs(speculative.parse_args(["--methods", "off,ngram"]))

    speculative.analyse(configs, runs, 16)

    off, ngram = runs["off"]["levels"], runs["ngram"]["levels"]
    assert "exactness" not in off[0]
    assert off[1]["exactness"]["num_differing"] == 1
    assert [lv["speed_up"] for lv in ngram] == [1.1, 1.0]
    assert [lv["exactness"]["num_differing"] for lv in ngram] == [0, 0]
    (row,) = runs["ngram"]["summary"]
    assert row["speed_up"] == 1.05
    assert row["speed_up_range"] == [1.0, 1.1]
