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

FAULT = "engine_core:raise:when=num_requests>=3"
NUM_CLIENTS = 4


def _crowd(base_url: str) -> None:
    """Four concurrent completions: the step that batches three of them fails."""

    def one(index: int) -> None:
        body = {"prompt": f"request {index} " * 8, "max_tokens": 40, "ignore_eos": True}
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


@pytest.fixture
def dump_file(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]], tmp_path: Path
) -> Path:
    directory = tmp_path / "dumps"
    server, _ = start_server("--crash-dump-dir", str(directory), fault=FAULT)
    _crowd(server.base_url)
    assert wait_exit(server) == 1
    [path] = list(directory.glob("crash-*.json"))
    return path


def test_replay_reproduces_names_a_different_failure_or_none(
    dump_file: Path, tiny_model_dir: str, tmp_path: Path
) -> None:
    dump = json.loads(dump_file.read_text())
    batch = dump["scheduler_output"]
    assert batch["num_requests"] >= 3
    assert dump["failure"] == {**dump["failure"], "process": "engine_core", "type": "InjectedFault"}

    same = _replay(dump_file, fault=FAULT)
    assert (same.returncode, same.stdout.strip()) == (0, "replay: reproduced"), same.stderr
    clean = _replay(dump_file, fault=None)
    assert (clean.returncode, clean.stdout.strip()) == (1, "replay: no failure"), clean.stderr
    other = _replay(dump_file, fault="engine_core:oom:when=num_requests>=3")
    assert other.returncode == 2, other.stderr
    assert other.stdout.strip() == (
        "replay: different failure: InjectedOutOfMemoryError in engine_core"
    )

    moved = tmp_path / "moved.json"
    dump["engine"]["model"]["model"] = str(tmp_path / "not-here")
    moved.write_text(json.dumps(dump))
    missing = _replay(moved, fault=FAULT)
    assert missing.returncode == 3
    assert "pass --model" in missing.stderr
    given = _replay(moved, "--model", tiny_model_dir, fault=FAULT)
    assert (given.returncode, given.stdout.strip()) == (0, "replay: reproduced"), given.stderr
