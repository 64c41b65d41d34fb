"""A signal inside a compiled kernel, on an OpenMP worker thread or on the thread that called
the kernel, ends like an exception: every client's error and the crash dump name the
signal, the kernel and the Python frame that called it.

Each case serves the tiny model with a kernel fault (`OTEL_ENGINE_FAULT`, the kernels
library's `fault_drill`) at step 200 while four clients (two streaming) are in flight, at
TP 1 (the model in the engine core) or TP 2 (in worker rank 1). bench/native_fault_drill.py
runs the same cases many times over.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_engine.observability.faults import FaultKind
from tests.failures.crowd import assert_all_failed
from tests.helpers.native_faults import Case, run_case

pytestmark = pytest.mark.slow  # starts servers

CASES = [
    Case(FaultKind.NATIVE_THREAD_SEGFAULT, tp=1),
    Case(FaultKind.NATIVE_THREAD_SEGFAULT, tp=2),
    Case(FaultKind.KERNEL_SEGFAULT, tp=1),
    Case(FaultKind.KERNEL_SEGFAULT, tp=2),
    Case(FaultKind.NATIVE_THREAD_FPE, tp=1),
    Case(FaultKind.NATIVE_THREAD_BUS_ERROR, tp=2),
    Case(FaultKind.NATIVE_THREAD_SEGFAULT, tp=1, where="engine_core"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_fault_names_signal_kernel_and_frame_to_every_client_and_in_the_dump(
    case: Case, tiny_model_dir: str, tmp_path: Path
) -> None:
    """Every client fails with the dead process's cause, its error naming the signal, the
    thread, the kernel and the calling frame; the dump file and its one log line carry the
    signal and the frames, kernel first; the server exits 1."""
    outcome = run_case(case, tiny_model_dir, tmp_path)

    assert 1 == outcome.exit_code, outcome.log_tail
    assert_all_failed(outcome.results, case.cause)
    assert [] == outcome.client_mismatches()
    assert [] == outcome.dump_mismatches(), outcome.failure
