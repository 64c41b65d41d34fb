"""The crash dump's `history` (the engine core's last steps as plain numbers, oldest first,
cut before the failing batch is; its cost per step) and the `--crash-dump-dir` file."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_engine import LLM, EngineDeadError, SamplingParams
from otel_engine.observability import faults
from otel_engine.observability.crash_delivery import write_dump_file
from otel_engine.observability.crash_dump import MAX_DUMP_BYTES, cap, to_json
from otel_engine.observability.step_history import FIELDS, StepHistory
from otel_engine.timing import CRASH_FILE_WRITE_S


def test_the_ring_keeps_the_last_steps_oldest_first() -> None:
    history = StepHistory(3)
    for step in range(1, 6):
        history.record((step, *[0.5] * (len(FIELDS) - 1)))

    part = history.part()

    assert part["fields"] == list(FIELDS)
    assert [row[0] for row in part["steps"]] == [3, 4, 5]
    assert (part["num_steps_recorded"], part["num_omitted_steps"]) == (5, 2)
    assert StepHistory(0).part()["steps"] == []


def test_history_is_cut_before_the_failing_batch() -> None:
    history = StepHistory(256)
    for step in range(1000):
        history.record((step, *[123456.789012] * (len(FIELDS) - 1)))
    requests = [{"request_id": f"r{i}", "block_ids": list(range(1000, 1256))} for i in range(32)]
    dump: dict[str, Any] = {
        "scheduler_output": {"requests": requests, "num_omitted_requests": 0},
        "history": history.part(),
    }

    capped = cap(dump)

    assert len(to_json(capped)) <= MAX_DUMP_BYTES
    assert len(capped["scheduler_output"]["requests"]) == 32  # the failing batch is whole
    steps = capped["history"]["steps"]
    assert 0 < len(steps) < 256
    assert steps[-1][0] == 999  # the newest steps are the ones kept
    assert capped["history"]["num_omitted_steps"] == 1000 - len(steps)


def test_recording_a_step_costs_microseconds() -> None:
    """The per-step cost the note quotes: the ring write of one step's numbers."""
    history = StepHistory(64)
    row = (1, time.time(), 0.01, 8, 1, 40, 0, 0.5, 3, 8, 0, 0, 0.0)
    started = time.perf_counter()
    for _ in range(100_000):
        history.record(row)
    per_step_us = (time.perf_counter() - started) / 100_000 * 1e6
    assert per_step_us < 10  # loose: the note has the measured number


@pytest.mark.slow
@pytest.mark.parametrize("size", [4, 0])
def test_a_crash_dump_shows_the_steps_before_the_crash(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    size: int,
) -> None:
    """The engine core raises at step 9: the dump's history holds steps 5-8 (or none with
    --crash-history-steps 0), as numbers, with no request id in it."""
    spec = "engine_core:raise:step=9"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    monkeypatch.setattr(faults, "_FAULTS", faults.Fault.parse_list(spec))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with (
        caplog.at_level(logging.CRITICAL),
        LLM(tiny_model_dir, crash_history_steps=size, num_kv_blocks=64) as llm,
        pytest.raises(EngineDeadError),
    ):
        llm.generate(tiny_prompts[:3], params)

    [record] = [r for r in caplog.records if r.getMessage() == "engine_crash_dump"]
    history = record.history  # type: ignore[attr-defined]
    steps = history["steps"]
    assert [row[0] for row in steps] == list(range(9 - size, 9))
    for row in steps:
        values = dict(zip(history["fields"], row, strict=True))
        assert values["num_requests"] >= 1
        assert values["duration_s"] >= 0
        assert 0 <= values["kv_cache_usage"] <= 1
        assert all(isinstance(v, int | float) for v in row)
    assert "offline-" not in to_json(history)  # no request id


@pytest.mark.slow
def test_the_history_says_what_grammar_masks_cost_each_step(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With a structured request in the batch, each step's `grammar_mask_s` is the time its
    masks took (> 0), within the step's duration; the schema appears nowhere in the dump."""
    from otel_engine.engine.structured_output import from_response_format

    spec = "engine_core:raise:step=6"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    monkeypatch.setattr(faults, "_FAULTS", faults.Fault.parse_list(spec))
    schema = {"type": "object", "properties": {"secret_field_name": {"type": "integer"}}}
    structured = from_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_output=structured)
    with (
        caplog.at_level(logging.CRITICAL),
        LLM(tiny_model_dir, num_kv_blocks=64) as llm,
        pytest.raises(EngineDeadError),
    ):
        llm.generate(tiny_prompts[:1], params)

    [record] = [r for r in caplog.records if r.getMessage() == "engine_crash_dump"]
    history = record.history  # type: ignore[attr-defined]
    rows = [dict(zip(history["fields"], row, strict=True)) for row in history["steps"]]
    assert rows
    for values in rows:
        assert 0 < values["grammar_mask_s"] <= values["duration_s"]
    assert "secret_field_name" not in to_json(record.__dict__)


@pytest.mark.slow
def test_crash_dump_dir_gets_the_dump_as_a_private_file(
    tiny_model_dir: str,
    tiny_prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    """--crash-dump-dir: one file crash-<utc>-<pid>.json, mode 0600, no temp file left,
    holding the dump's parts, the failure and the engine config; its path in the log line."""
    spec = "engine_core:raise:step=4"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    monkeypatch.setattr(faults, "_FAULTS", faults.Fault.parse_list(spec))
    directory = tmp_path / "dumps"
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with (
        caplog.at_level(logging.CRITICAL),
        LLM(tiny_model_dir, crash_dump_dir=str(directory), num_kv_blocks=64) as llm,
        pytest.raises(EngineDeadError),
    ):
        llm.generate(tiny_prompts[:2], params)

    [path] = list(directory.iterdir())
    assert re.fullmatch(rf"crash-\d{{8}}T\d{{6}}\.\d{{6}}Z-{os.getpid()}\.json", path.name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    content = json.loads(path.read_text())
    assert {"scheduler_output", "engine_config", "system_stats", "history"} <= set(content)
    assert content["failure"]["process"] == "engine_core"
    assert content["engine"]["model"]["model"] == tiny_model_dir
    assert [row[0] for row in content["history"]["steps"]] == [1, 2, 3]
    [record] = [r for r in caplog.records if r.getMessage() == "engine_crash_dump"]
    assert record.dump_path == str(path)  # type: ignore[attr-defined]


def test_a_dump_file_that_cannot_be_written_is_logged_and_skipped(tmp_path: Path) -> None:
    """A directory that cannot be made: None and one error line, nothing raised."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    logger = logging.getLogger("test.dump_file")
    with _capture(logger) as records:
        path = write_dump_file(str(blocker / "dumps"), {"x": 1}, {}, None, logger)

    assert path is None
    assert [r.getMessage() for r in records] == ["engine_crash_dump.file_failed"]


@contextlib.contextmanager
def _capture(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_dump_file_write_that_hangs_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system that hangs (simulated: the rename sleeps) holds the crash path for at
    most CRASH_FILE_WRITE_S: None and one error line."""
    from otel_engine.observability import crash_delivery

    monkeypatch.setattr(crash_delivery.os, "replace", lambda *_: time.sleep(3))
    logger = logging.getLogger("test.dump_file_hang")
    started = time.monotonic()
    with _capture(logger) as records:
        path = write_dump_file(str(tmp_path), {"x": 1}, {}, None, logger)

    assert path is None
    assert time.monotonic() - started < CRASH_FILE_WRITE_S + 0.5
    assert [r.getMessage() for r in records] == ["engine_crash_dump.file_failed"]
