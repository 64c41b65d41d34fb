"""One native-fault drill against a real server, and what it said of the fault.

`run_case` starts `otel-engine serve` on a model with a kernel fault (`OTEL_ENGINE_FAULT`,
`observability/faults.py`'s `KERNEL_FAULTS`) at step `FAULT_STEP`, sends a crowd of clients
(half streaming), and returns every client's result, the server's exit code and the crash
dump (its `--crash-dump-dir` file and its `engine_crash_dump` log lines). `Outcome`'s
`client_mismatches` and `dump_mismatches` say what did not name the signal, the kernel and
the Python frame; empty when everything did. Shared by tests/failures/test_native_thread_fault.py
and bench/native_fault_drill.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_engine.ipc.native_fault import KERNELS_FILE
from otel_engine.observability.faults import KERNEL_FAULTS, DrillThread, FaultKind
from tests.failures.crowd import ClientResult, run_crowd
from tests.helpers.procs import ServerProcess

FAULT_STEP = 200  # of 480 tokens: every request has joined, none can have finished
NUM_CLIENTS = 4
KERNEL = "fault_drill"  # the kernels library's entry point that faults on purpose
CALLER = ("maybe_inject", "otel_engine/observability/faults.py")  # the Python frame named
EXIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Case:
    """A kernel fault at a tensor-parallel size, in a worker (the last rank at TP > 1) or in
    the engine core."""

    kind: FaultKind
    tp: int
    where: str = "worker"

    @property
    def id(self) -> str:
        return f"tp{self.tp}-{self.where}-{self.kind}"

    @property
    def signal(self) -> str:
        return KERNEL_FAULTS[self.kind][0].name

    @property
    def is_native_thread(self) -> bool:
        return KERNEL_FAULTS[self.kind][1] is DrillThread.OPENMP_WORKER

    @property
    def spec(self) -> str:
        rank = f":rank={self.tp - 1}" if self.where == "worker" else ""
        return f"{self.where}:{self.kind}{rank}:step={FAULT_STEP}"

    @property
    def process(self) -> str:
        """The process that dies: a worker rank's own at TP > 1, else the engine core."""
        if self.where == "worker" and self.tp > 1:
            return f"otel-worker-{self.tp - 1}"
        return "engine_core"

    @property
    def cause(self) -> str:
        return "EngineCoreDied" if self.process == "engine_core" else "WorkerDied"

    @property
    def location(self) -> str:
        """How the error says where, up to the caller's line number."""
        thread = " on a non-Python thread" if self.is_native_thread else ""
        function, file = CALLER
        return (
            f"died of {self.signal}{thread} in kernel {KERNEL}, called from {function} at {file}:"
        )


@dataclass
class Outcome:
    """What one run left: the clients' results, the exit code, the dump."""

    case: Case
    exit_code: int | None
    results: list[ClientResult]
    failure: dict[str, Any] | None  # the --crash-dump-dir file's failure part
    dump_lines: list[dict[str, Any]] = field(default_factory=list)  # engine_crash_dump
    log_tail: str = ""

    def client_mismatches(self) -> list[str]:
        """Each client whose error does not name the process, signal, kernel and frame."""
        expected = f"{self.case.cause} in {self.case.process}: {self.case.location}"
        wrong = []
        for index, result in enumerate(self.results):
            message = (result.error or {}).get("message", "")
            if expected not in message:
                wrong.append(f"client {index}: {message or _summary(result)}")
        return wrong

    def dump_mismatches(self) -> list[str]:
        """What in the dump (the file's failure part, the one log line) does not name the
        signal, the kernel's frame, the caller's frame and the location."""
        failure = self.failure
        if failure is None:
            return ["no --crash-dump-dir file"]
        frames = [(f["function"], f["file"]) for f in failure.get("frames", [])]
        wrong = []
        if (self.case.process, self.case.signal) != (failure["process"], failure["signal"]):
            wrong.append(f"failure names {failure['process']}, {failure['signal']}")
        if frames[:2] != [(KERNEL, KERNELS_FILE), CALLER]:
            wrong.append(f"innermost frames {frames[:2]}")
        if self.case.location not in failure["message"]:
            wrong.append(f"message {failure['message']!r}")
        if len(self.dump_lines) != 1:
            wrong.append(f"{len(self.dump_lines)} engine_crash_dump lines")
        elif (failure["signal"], failure["frames"]) != (
            self.dump_lines[0].get("signal"),
            self.dump_lines[0].get("frames"),
        ):
            wrong.append("the log line's signal and frames differ from the file's")
        return wrong


def _summary(result: ClientResult) -> str:
    """A client that got no error, without the text it streamed."""
    return (
        f"no error: status {result.status}, {len(result.events)} events, hung {result.hung}, "
        f"transport error {result.transport_error}"
    )


def run_case(case: Case, model_dir: str, work_dir: Path) -> Outcome:
    """Serve `model_dir` with `case`'s fault, run the crowd into it, and collect what the
    clients and the dump said; everything the server started is gone when it returns."""
    dump_dir = work_dir / "dumps"
    server = ServerProcess(
        [
            *("--model", model_dir, "--num-kv-blocks", "256", "--log-level", "INFO"),
            *("--tensor-parallel-size", str(case.tp), "--crash-dump-dir", str(dump_dir)),
        ],
        env={"OTEL_ENGINE_FAULT": case.spec},
        log_path=work_dir / "server.log",
    )
    try:
        server.start()
        server.wait_healthy(timeout=120)
        results = asyncio.run(run_crowd(server.base_url, NUM_CLIENTS))
        try:
            exit_code: int | None = server.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            exit_code = None
    finally:
        server.cleanup()
    files = sorted(dump_dir.glob("crash-*.json"))
    failure = json.loads(files[0].read_text())["failure"] if len(files) == 1 else None
    lines = [r for r in server.json_lines() if r.get("event") == "engine_crash_dump"]
    return Outcome(case, exit_code, results, failure, lines, server.tail())
