"""`otel-engine replay`: a server crashes on a fault that depends on the batch's shape under
real traffic and writes its dump file; replaying that file reproduces the failure with the
same fault, reports none without it, and names a different one."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.failures.conftest import ProcessWatch, wait_exit
from tests.helpers.procs import ServerProcess

pytestmark = pytest.mark.slow  # starts servers or engine processes

NUM_CLIENTS = 4
# (tensor parallel size, the fault, the same fault as an out-of-memory error)
CASES = {
    "engine_core-tp1": (
        1,
        "engine_core:raise:when=num_requests>=3",
        "engine_core:oom:when=num_requests>=3",
    ),
    "worker-rank1-tp2": (
        2,
        "worker:raise:rank=1:when=num_requests>=3",
        "worker:oom:rank=1:when=num_requests>=3",
    ),
}


def _crowd(base_url: str) -> None:
    """Four concurrent completions: the step that batches three of them fails.

    They start together and each runs long enough (the tiny model decodes a token in well
    under a millisecond) that they overlap however the threads are scheduled."""
    start = threading.Barrier(NUM_CLIENTS)

    def one(index: int) -> None:
        body = {"prompt": f"request {index} " * 8, "max_tokens": 400, "ignore_eos": True}
        start.wait(30)
        with contextlib.suppress(httpx.HTTPError):  # the server is going down
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=60, trust_env=False)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)


def _replay(path: Path, *args: str, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OTEL_ENGINE_FAULT"}
    if fault:
        env["OTEL_ENGINE_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "otel_engine.cli", "replay", str(path), *args],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(params=sorted(CASES))
def case(
    request: pytest.FixtureRequest,
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]],
    tmp_path: Path,
) -> tuple[Path, str, str]:
    """The dump file a server wrote when the fault hit, the fault, and its OOM variant."""
    tp, fault, oom = CASES[request.param]
    directory = tmp_path / "dumps"
    server, _ = start_server(
        "--crash-dump-dir", str(directory), "--tensor-parallel-size", str(tp), fault=fault
    )
    _crowd(server.base_url)
    assert wait_exit(server) == 1
    [path] = list(directory.glob("crash-*.json"))
    return path, fault, oom


def test_replay_reproduces_names_a_different_failure_or_none(
    case: tuple[Path, str, str], tiny_model_dir: str, tmp_path: Path
) -> None:
    dump_file, fault, oom = case
    dump = json.loads(dump_file.read_text())
    assert dump["scheduler_output"]["num_requests"] >= 3
    assert dump["failure"]["type"] == "InjectedFault"
    process = dump["failure"]["process"]

    same = _replay(dump_file, fault=fault)
    assert (same.returncode, same.stdout.strip()) == (0, "replay: reproduced"), same.stderr
    clean = _replay(dump_file, fault=None)
    assert (clean.returncode, clean.stdout.strip()) == (1, "replay: no failure"), clean.stderr
    other = _replay(dump_file, fault=oom)
    assert other.returncode == 2, other.stderr
    assert other.stdout.strip() == (
        f"replay: different failure: InjectedOutOfMemoryError in {process}"
    )

    moved = tmp_path / "moved.json"
    dump["engine"]["model"]["model"] = str(tmp_path / "not-here")
    moved.write_text(json.dumps(dump))
    missing = _replay(moved, fault=fault)
    assert missing.returncode == 3
    assert "pass --model" in missing.stderr
    given = _replay(moved, "--model", tiny_model_dir, fault=fault)
    assert (given.returncode, given.stdout.strip()) == (0, "replay: reproduced"), given.stderr
    cramped = _replay(dump_file, "--num-kv-blocks", "1", fault=fault)
    assert cramped.returncode == 3, cramped.stdout
    assert "pass --num-kv-blocks" in cramped.stderr


NO_BATCH = '{"engine": {}, "failure": {}, "scheduler_output": {"requests": [{"x": 1}]}}'
EMPTY_BATCH = '{"engine": {}, "failure": {}, "scheduler_output": {"requests": []}}'


@pytest.mark.parametrize("content", ["not json", '{"engine": {}}', "[1, 2]", NO_BATCH, EMPTY_BATCH])
def test_a_file_that_is_no_dump_cannot_be_replayed(tmp_path: Path, content: str) -> None:
    """Exit 3 with the reason on stderr, before any engine starts."""
    path = tmp_path / "crash.json"
    path.write_text(content)

    result = _replay(path, fault=None)

    assert result.returncode == 3
    assert "replay: cannot replay:" in result.stderr
