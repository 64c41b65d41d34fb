"""The engine's view of every rank's fast-path plan (`executor/rank_plans.py`): each rank's
summary passed through as it is, and the keys where the ranks differ flagged."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from otel_engine.executor.rank_plans import collect, rank_plans, runs_kernels


def _summary(cpu_isa: str = "avx512bf16", *, int4: bool = True) -> dict[str, Any]:
    return {
        "cpu_isa": cpu_isa,
        "kernel_isa": cpu_isa,
        "paths": {
            "compiled_kernels": {"enabled": True, "reason": None},
            "int4_kernels": {"enabled": int4, "reason": None if int4 else "no AVX-512 here"},
        },
        "choices": {"activations": "int8"},
    }


def test_alike_ranks_are_not_flagged() -> None:
    """Two ranks that decided alike: both plans, as reported, and no difference."""
    summaries = [_summary(), _summary()]

    plans = rank_plans(summaries)

    assert {"ranks": summaries, "ranks_differ": False, "differences": []} == plans


def test_ranks_that_differ_are_flagged_with_each_ranks_value() -> None:
    """Rank 1 on an AVX2 node: every key whose value differs, dotted, with each rank's value
    by rank, in rank 0's order; the keys that agree are not listed."""
    plans = rank_plans([_summary("avx512bf16"), _summary("avx2", int4=False)])

    assert plans["ranks_differ"] is True
    assert [
        {"key": "cpu_isa", "values": ["avx512bf16", "avx2"]},
        {"key": "kernel_isa", "values": ["avx512bf16", "avx2"]},
        {"key": "paths.int4_kernels.enabled", "values": [True, False]},
        {"key": "paths.int4_kernels.reason", "values": [None, "no AVX-512 here"]},
    ] == plans["differences"]


def test_a_key_only_one_rank_has_is_a_difference() -> None:
    """Keys are passed through unread: one that only rank 1 reports differs (None for rank 0)."""
    extra = _summary()
    extra["choices"]["amx_tiles"] = "on"

    plans = rank_plans([_summary(), extra])

    assert [{"key": "choices.amx_tiles", "values": [None, "on"]}] == plans["differences"]


def test_the_ranks_summaries_are_kept_as_reported() -> None:
    """The plans hold each rank's summary unchanged, by rank, whatever keys it has."""
    summaries = [_summary(), {**_summary("avx2"), "matrices": {"dense": 4}}]
    reported = copy.deepcopy(summaries)

    assert reported == rank_plans(summaries)["ranks"]
    assert reported == summaries


def test_ranks_that_differ_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """`collect` warns once (`kernels.ranks_differ`) with the keys that differ; alike ranks
    log nothing."""
    with caplog.at_level(logging.INFO, logger="otel_engine.executor.rank_plans"):
        collect([_summary(), _summary()])
        collect([_summary(), _summary(int4=False)])

    records = [r for r in caplog.records if r.name == "otel_engine.executor.rank_plans"]
    assert [("kernels.ranks_differ", logging.WARNING)] == [
        (r.getMessage(), r.levelno) for r in records
    ]
    keys = ["paths.int4_kernels.enabled", "paths.int4_kernels.reason"]
    assert (2, keys) == (records[0].num_ranks, records[0].keys)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("plans", "expected"),
    [
        (rank_plans([_summary()]), True),
        (rank_plans([{"paths": {"compiled_kernels": {"enabled": False}}}, _summary()]), False),
        (None, False),
    ],
)
def test_runs_kernels_reads_rank_zeros_plan(plans: dict[str, Any] | None, expected: bool) -> None:
    """What a crash dump's tensor shapes follow: rank 0's compiled_kernels (none: False)."""
    assert expected == runs_kernels(plans)
