"""Which rank hung (TP > 1): after a step timeout the engine core asks every worker where it
is (`executor/hang.py`, each worker's `responder` thread) and names the one that stopped.

The decision is tested on reports as the workers send them; the whole path with real
servers at TP=2 and TP=3 and the existing hang fault (`worker:hang:rank=R:step=S`): every
client's error, the log line and the dump file name rank R and where its main thread is.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from otel_engine.config import EngineConfig
from otel_engine.executor.hang import hang_error, hung_rank, ranks_part
from otel_engine.ipc.messages import RankReport, StackFrame
from tests.failures.conftest import ProcessWatch, log_time, wait_exit
from tests.failures.crowd import assert_all_failed, run_crowd
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import write_tiny_llama

FAULT_STEP = 120
STEP_TIMEOUT_S = 2.0
ERROR_LIMIT_S = 1.5  # from the step timeout to the clients' errors
HUNG_AT = "otel_engine/observability/faults.py"
IN_BUSY_LOOP = [StackFrame("otel_engine/executor/worker.py", 110, "_busy_loop")]
IN_COLLECTIVE = [
    *IN_BUSY_LOOP,
    StackFrame("torch/distributed/distributed_c10d.py", 3252, "all_reduce"),
]
IN_FAULT = [*IN_BUSY_LOOP, StackFrame(HUNG_AT, 118, "maybe_inject")]


def report(rank: int, enqueued: int, stack: list[StackFrame]) -> RankReport:
    completed = min(enqueued, 16)
    return RankReport(rank, 5, enqueued, completed, "gloo:all_reduce", stack)


def test_the_rank_behind_the_others_is_named_with_its_innermost_frame() -> None:
    reports = [report(0, 17, IN_COLLECTIVE), report(1, 16, IN_FAULT), report(2, 17, IN_COLLECTIVE)]
    culprit = hung_rank(reports)

    assert culprit is not None
    assert (1, "behind") == (culprit.rank, culprit.reason)
    error = hang_error(5, EngineConfig.from_kwargs(model="m", step_timeout=2), "x", reports)
    assert "otel-worker-1" == error.process
    assert error.message.startswith(f"rank 1 hung in maybe_inject at {HUNG_AT}:118; step 5")
    assert f"rank 1 hung in maybe_inject at {HUNG_AT}:118" == error.location
    part = ranks_part(reports)
    assert ["behind"] == [r["hung"] for r in part if "hung" in r]
    assert f"maybe_inject at {HUNG_AT}:118" == part[1]["stack"][-1]  # type: ignore[index]


def test_a_rank_that_does_not_answer_is_the_culprit() -> None:
    reports = [report(0, 17, IN_COLLECTIVE), None]
    culprit = hung_rank(reports)

    assert culprit is not None
    assert (1, "no answer") == (culprit.rank, culprit.reason)
    error = hang_error(5, EngineConfig.from_kwargs(model="m", step_timeout=2), "x", reports)
    assert error.message.startswith("rank 1 hung and did not answer; step 5 made no progress")
    assert {"rank": 1, "answered": False} == ranks_part(reports)[1]


def test_equal_collectives_name_the_rank_outside_the_collective() -> None:
    """Every rank reached the same collective, but one is not waiting in it (it hangs
    between collectives, e.g. in its own Python code)."""
    reports = [report(0, 16, IN_COLLECTIVE), report(1, 16, IN_COLLECTIVE), report(2, 16, IN_FAULT)]
    culprit = hung_rank(reports)

    assert culprit is not None
    assert (2, "outside the collective") == (culprit.rank, culprit.reason)


def test_reports_that_single_out_nobody_keep_the_plain_timeout() -> None:
    """All in the same collective (a peer outside the group, a deadlocked library): no rank
    is blamed, the error is the plain step timeout of the engine core."""
    reports = [report(0, 16, IN_COLLECTIVE), report(1, 16, IN_COLLECTIVE)]
    assert hung_rank(reports) is None
    assert hung_rank([]) is None
    error = hang_error(5, EngineConfig.from_kwargs(model="m", step_timeout=2), "core", reports)
    assert ("core", "step 5 made no progress in 2 s (see --step-timeout)") == (
        error.process,
        error.message,
    )


@pytest.fixture(scope="module")
def divisible_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with heads, KV heads and MLP rows that split over 2 and 3 ranks."""
    path = tmp_path_factory.mktemp("tiny-llama-tp3")
    return write_tiny_llama(path, hidden=96, heads=6, kv_heads=6, intermediate=192)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "rank"), [(2, 1), (3, 0), (3, 2)])
def test_a_hung_rank_is_named_to_every_client_and_in_the_dump(
    tp: int,
    rank: int,
    divisible_model_dir: str,
    tmp_path: Path,
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
) -> None:
    """`worker:hang:rank=R` at TP=2 and TP=3: every client's error says "rank R hung in
    maybe_inject at .../faults.py:<line>" within 1.5 s of the step timeout; the dump
    file's failure names rank R, and its `ranks` part has every rank's answer, R's marked
    as behind its peers' collectives."""
    dump_dir = tmp_path / "dumps"
    server, _ = start_server(
        "--tensor-parallel-size",
        str(tp),
        "--step-timeout",
        str(STEP_TIMEOUT_S),
        "--crash-dump-dir",
        str(dump_dir),
        fault=f"worker:hang:rank={rank}:step={FAULT_STEP}",
        model_dir=divisible_model_dir,
    )

    results = asyncio.run(run_crowd(server.base_url, 4))
    assert 1 == wait_exit(server, timeout=60), server.tail()

    assert_all_failed(results, f"rank {rank} hung in maybe_inject at {HUNG_AT}:")
    hung_at = log_time(server, "fault.injected")
    assert hung_at is not None
    last_error = max(r.ended_at or float("inf") for r in results)
    after_timeout = last_error - (hung_at + STEP_TIMEOUT_S)
    print(f"tp={tp} rank={rank}: step timeout -> last client error {after_timeout:.3f} s")
    assert after_timeout <= ERROR_LIMIT_S
    [name] = os.listdir(dump_dir)
    dump = json.loads((dump_dir / name).read_text())
    assert (rank, f"otel-worker-{rank}", "timeout") == (
        dump["failure"]["rank"],
        dump["failure"]["process"],
        dump["failure"]["how"],
    )
    ranks = dump["ranks"]
    assert list(range(tp)) == [r["rank"] for r in ranks]
    assert all(r["answered"] for r in ranks)
    assert [rank] == [r["rank"] for r in ranks if r.get("hung") == "behind"]
    assert all(r["step_id"] == FAULT_STEP for r in ranks)
    peers = [r for r in ranks if r["rank"] != rank]
    assert all(r["last_collective"] == "gloo:all_reduce" for r in ranks)
    assert all(
        r["last_enqueued_collective"] > ranks[rank]["last_enqueued_collective"] for r in peers
    )
    [crash_line] = [r for r in server.json_lines() if r.get("event") == "engine_crash_dump"]
    assert rank == crash_line["failed_rank"]
    assert crash_line["ranks"] == ranks


def test_ask_ranks_answers_for_a_live_responder_and_none_for_a_silent_rank(
    tmp_path: Path,
) -> None:
    """A real responder thread answers with its main thread's frames (this test's, here) and
    no collective (no process group); a rank whose socket nobody serves is None once the
    one deadline passed, without holding up the answer of the other."""
    import threading
    import time

    import zmq

    from otel_engine.executor.hang import ask_ranks
    from otel_engine.executor.responder import Responder

    live, silent = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/silent"
    responder = Responder(0, live)
    responder.step_id = 7
    context = zmq.Context()
    try:
        started = time.monotonic()
        reports = ask_ranks(context, [live, silent], timeout_s=0.3)
        waited = time.monotonic() - started
    finally:
        context.term()
        responder.stop()

    [answer, none] = reports
    assert none is None
    assert answer is not None
    assert (0, 7, -1, -1) == (
        answer.rank,
        answer.step_id,
        answer.last_enqueued_collective,
        answer.last_completed_collective,
    )
    assert threading.current_thread() is threading.main_thread()
    [here] = [
        f
        for f in answer.stack
        if f.function == "test_ask_ranks_answers_for_a_live_responder_and_none_for_a_silent_rank"
    ]
    assert "tests/failures/test_hung_rank.py" == here.file  # relative: no machine's paths
    assert 0.3 <= waited < 1.0
