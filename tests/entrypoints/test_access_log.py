"""The access log's budget per client (`access_log.py`)."""

from __future__ import annotations

import time

from otel_engine.entrypoints.network.access_log import MAX_CLIENTS, ClientLogBudget


def test_a_client_gets_its_lines_then_the_count_of_those_left_out() -> None:
    """Past its lines per interval a client's lines are suppressed; its first line in the
    next interval says how many."""
    budget = ClientLogBudget(lines=3, interval_s=0.05)

    taken = [budget.take("10.0.0.1") for _ in range(10)]
    time.sleep(0.06)

    assert [0, 0, 0] + [None] * 7 == taken
    assert 7 == budget.take("10.0.0.1")
    assert 0 == budget.take("10.0.0.1")


def test_clients_have_separate_budgets() -> None:
    """One client spending its budget leaves another's whole."""
    budget = ClientLogBudget(lines=2, interval_s=60)
    for _ in range(5):
        budget.take("10.0.0.1")

    assert [0, 0, None] == [budget.take("10.0.0.2") for _ in range(3)]


def test_many_addresses_share_one_budget_past_the_table_size() -> None:
    """Past MAX_CLIENTS current addresses, new ones share one budget: many addresses do not
    buy more lines."""
    budget = ClientLogBudget(lines=1, interval_s=60)
    for index in range(MAX_CLIENTS):
        assert 0 == budget.take(f"10.0.{index // 256}.{index % 256}")

    others = [budget.take(f"10.9.{index // 256}.{index % 256}") for index in range(100)]

    assert 1 == sum(1 for taken in others if taken is not None)
