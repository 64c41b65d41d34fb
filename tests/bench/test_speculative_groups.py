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
