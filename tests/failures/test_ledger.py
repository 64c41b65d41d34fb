"""The chaos ledger, short: clients of every kind while random faults fire, then exactly one
terminal record per request in each of the HTTP answer, the request span, the metrics and
the log line, all agreeing (tests/helpers/chaos.py, the drill `bench/chaos.py` runs for
minutes; tests/helpers/ledger.py, the reconciliation)."""

from __future__ import annotations

import pytest

from tests.helpers.chaos import RESTART, SHUTDOWN, ChaosConfig, ChaosResult, run_chaos
from tests.helpers.chaos_load import RequestKind

pytestmark = pytest.mark.slow  # starts servers

DURATION_S = 20.0


def _assert_ledger(result: ChaosResult) -> None:
    ledger = result.ledger
    assert 0 == ledger.num_mismatches, ledger.mismatches
    assert 0 == result.num_lost, [s for s in result.sent if s.lost]
    assert [] == result.unexpected
    assert 0 == result.comparison.num_different, result.comparison.examples
    assert 0 < result.comparison.num_requests
    assert [] == result.leftovers


def test_under_restarts_every_request_has_one_record_per_source_and_its_fault_free_output(
    long_context_model_dir: str,
) -> None:
    """Only requests the isolation convicts fail (each poison among them); every other one
    that completes is token for token what a fault-free server answers."""
    config = ChaosConfig(
        long_context_model_dir,
        RESTART,
        DURATION_S,
        num_clients=6,
        poison_every_s=6.0,
        kill_every_s=(4.0, 8.0),
    )

    result = run_chaos(config)

    _assert_ledger(result)
    assert 3 <= sum(result.faults.values()), result.faults
    assert 3 <= result.num_restarts, result.faults
    poisons = [s for s in result.sent if s.kind is RequestKind.POISON]
    assert poisons
    assert all((s.error or {}).get("code") == "engine_fault_request" for s in poisons), poisons
    # An innocent request may be failed as a poison too, by the rules (one in the batches
    # of two failures of the same type, at its first step both times): `result.innocents`,
    # which bench/chaos.py prints.
    assert [0] == result.exit_codes


def test_under_shutdowns_every_unfinished_request_gets_engine_dead(
    long_context_model_dir: str,
) -> None:
    """Server lives, each ended by a random fault: every request not finished got
    `engine_dead`, and each life exited 1."""
    config = ChaosConfig(long_context_model_dir, SHUTDOWN, DURATION_S, num_clients=6)

    result = run_chaos(config)

    _assert_ledger(result)
    assert 2 <= len(result.exit_codes)
    assert all(code == 1 for code in result.exit_codes[:-1]), result.exit_codes
    assert any(key.startswith("failed:engine_dead") for key in result.ledger.outcomes)
