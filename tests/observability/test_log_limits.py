"""An event logged over and over writes a line per interval, with the count it left out
(`log_limits.RateLimitedLog`)."""

from __future__ import annotations

import logging
import time

import pytest

from otel_engine.observability.log_limits import RateLimitedLog

LOGGER = "otel_engine.test_log_limits"


def test_one_line_per_interval_and_the_next_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = RateLimitedLog(logging.getLogger(LOGGER), interval_s=0.2)

    logged = [log.log(logging.INFO, "thing.happened", n=n) for n in range(50)]
    time.sleep(0.25)
    log.log(logging.INFO, "thing.happened", n=50)

    assert [True] + [False] * 49 == logged
    records = [r for r in caplog.records if r.getMessage() == "thing.happened"]
    assert [(0, 0), (50, 49)] == [(r.n, r.num_suppressed) for r in records]  # type: ignore[attr-defined]


def test_events_are_limited_each_on_their_own(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = RateLimitedLog(logging.getLogger(LOGGER))

    assert log.log(logging.INFO, "a.one")
    assert log.log(logging.INFO, "b.two")
    assert not log.log(logging.INFO, "a.one")


def test_the_logged_line_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    log = RateLimitedLog(logging.getLogger(LOGGER))
    try:
        raise RuntimeError("a bug")
    except RuntimeError as error:
        log.log(logging.ERROR, "request.internal_error", exc_info=error)
        log.log(logging.ERROR, "request.internal_error", exc_info=error)

    [record] = caplog.records
    assert record.exc_info is not None
    assert RuntimeError is record.exc_info[0]
