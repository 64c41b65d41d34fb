"""Native faults: faulthandler's report parsed from real output, and a child's death by a
signal described by its signal and innermost frames."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_engine.errors import FailureCause
from otel_engine.ipc.messages import StackFrame
from otel_engine.ipc.native_fault import (
    KERNELS_FILE,
    FaultReport,
    location,
    parse_report,
    short_path,
)
from otel_engine.ipc.process import ChildProcess, spawn
from otel_engine.model import kernels

TARGETS = "tests.ipc.targets"
# A fault two calls deep, with a second thread alive: its stack must not be taken for the
# faulting one.
FAULTING_SCRIPT = textwrap.dedent(
    """
    import ctypes, faulthandler, sys, threading, time
    faulthandler.enable(open(sys.argv[1], "w"), all_threads=True)
    threading.Thread(target=lambda: time.sleep(60), name="bystander", daemon=True).start()
    time.sleep(0.05)

    def inner():
        ctypes.string_at(0)

    def outer():
        inner()

    outer()
    """
)


KERNEL_CALL_SCRIPT = Path(__file__).with_name("kernel_call_fault.py")


def _kernel_call_report(tmp_path: Path, thread: str) -> tuple[int, str]:
    """Run kernel_call_fault.py (`thread`: "caller" or "thread"); its exit code and report."""
    path = tmp_path / "fault.txt"
    argv = [str(KERNEL_CALL_SCRIPT), str(path), kernels.__file__, thread]
    code = subprocess.run(
        [sys.executable, *argv], check=False, capture_output=True, timeout=30
    ).returncode
    return code, path.read_text()


def _real_report(tmp_path: Path, script: str = FAULTING_SCRIPT) -> tuple[int, str]:
    """Run `script` in a fresh interpreter; its exit code and what faulthandler wrote."""
    path = tmp_path / "fault.txt"
    code = subprocess.run(
        [sys.executable, "-c", script, str(path)], check=False, capture_output=True, timeout=30
    ).returncode
    return code, path.read_text()


def test_parser_takes_the_signal_and_the_faulting_threads_frames_innermost_first(
    tmp_path: Path,
) -> None:
    """On real faulthandler output: SIGSEGV, and the current thread's frames (ctypes's
    string_at, then inner, outer, <module>), not the bystander thread's."""
    code, text = _real_report(tmp_path)
    assert -11 == code
    assert "Thread 0x" in text  # the other thread is in the text too

    report = parse_report(text)

    assert report is not None
    assert "SIGSEGV" == report.signal
    assert ["string_at", "inner", "outer", "<module>"] == [f.function for f in report.frames]
    assert "ctypes/__init__.py" == report.frames[0].file
    assert report.frames[0].line > 0


def test_parser_takes_the_thread_blocked_in_a_kernel_when_a_native_thread_faulted(
    tmp_path: Path,
) -> None:
    """A signal on a thread C started: faulthandler marks no thread current, and the report
    is the Python thread waiting in the kernel call (not the bystander): the kernel is its
    innermost frame, in kernels.py, and the place the first frame outside it."""
    code, text = _kernel_call_report(tmp_path, "thread")
    assert -11 == code
    assert "Current thread" not in text

    report = parse_report(text)

    assert report is not None
    assert ("SIGSEGV", True) == (report.signal, report.is_native_thread)
    functions = [f.function for f in report.frames]
    assert ["decode_attention_bf16", "forward", "main", "<module>"] == functions
    assert (KERNELS_FILE, "decode_attention_bf16") == (report.frames[0].file, report.kernel)
    assert report.describe().startswith(
        "died of SIGSEGV on a non-Python thread in kernel decode_attention_bf16, "
        "called from forward at "
    )


def test_parser_names_the_kernel_that_faulted_on_the_calling_thread(tmp_path: Path) -> None:
    """A kernel that faults on the thread that called it: the current thread's frames, the
    kernel named the same way."""
    code, text = _kernel_call_report(tmp_path, "caller")
    assert -11 == code

    report = parse_report(text)

    assert report is not None
    assert ("SIGSEGV", False) == (report.signal, report.is_native_thread)
    functions = [f.function for f in report.frames]
    assert ["decode_attention_bf16", "forward", "main", "<module>"] == functions
    assert report.describe().startswith(
        "died of SIGSEGV in kernel decode_attention_bf16, called from forward at "
    )


def test_native_thread_fault_outside_a_kernel_call_has_no_frames() -> None:
    """No thread current and none in a kernel call: the signal alone, said to be on a
    non-Python thread, never another thread's frames."""
    text = (
        "Fatal Python error: Bus error\n\n"
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/srv/otel_engine/executor/worker.py", line 110 in busy_loop\n'
    )

    report = parse_report(text)

    assert report == FaultReport("SIGBUS", (), is_native_thread=True)
    assert "died of SIGBUS on a non-Python thread" == report.describe()


def test_kernel_and_caller_are_named_from_the_frames() -> None:
    """The kernel is the innermost frame's function when it is in kernels.py; the place is
    the first frame outside it."""
    wrapper = StackFrame(KERNELS_FILE, 80, "quant_linear_bf16")
    caller = StackFrame("otel_engine/model/quant.py", 52, "__call__")
    outer = StackFrame("otel_engine/model/llama.py", 300, "forward")

    said = FaultReport("SIGFPE", (wrapper, caller, outer)).describe()

    assert (
        "died of SIGFPE in kernel quant_linear_bf16, called from __call__ at "
        "otel_engine/model/quant.py:52"
    ) == said
    assert "" == FaultReport("SIGFPE", (caller, wrapper)).kernel
    assert (
        "died of SIGFPE in kernel quant_linear_bf16" == FaultReport("SIGFPE", (wrapper,)).describe()
    )


def test_parser_reads_an_abort_without_other_threads(tmp_path: Path) -> None:
    """os.abort() under faulthandler without all_threads: SIGABRT and the one frame."""
    script = "import faulthandler, os, sys; faulthandler.enable(open(sys.argv[1], 'w')); os.abort()"
    code, text = _real_report(tmp_path, script)
    assert -6 == code

    report = parse_report(text)

    assert report is not None
    assert ("SIGABRT", ["<module>"]) == (report.signal, [f.function for f in report.frames])


@pytest.mark.parametrize("text", ["", "something else\n", "Fatal Python error: Aborted\n"])
def test_parser_without_frames_has_none(text: str) -> None:
    """Nothing a report: None; a header only: the signal without frames."""
    report = parse_report(text)
    assert (report.frames if report else None) in (None, ())


def test_location_is_the_innermost_frame_of_the_package_else_the_innermost() -> None:
    """A fault in a library called from the engine is placed at the engine's frame."""
    library = StackFrame("torch/nn/functional.py", 10, "linear")
    ours = StackFrame("otel_engine/model/llama.py", 300, "forward")
    outer = StackFrame("otel_engine/executor/worker.py", 110, "_busy_loop")

    assert "forward at otel_engine/model/llama.py:300" == location([library, ours, outer])
    assert "linear at torch/nn/functional.py:10" == location([library])
    assert "" == location([])
    assert "died of SIGSEGV" == FaultReport("SIGSEGV").describe()


def test_paths_are_shortened_to_no_machine_path() -> None:
    """site-packages, the project's root and the standard library are cut off."""
    from otel_engine.observability import faults

    assert "otel_engine/observability/faults.py" == short_path(faults.__file__)
    assert "torch/nn/functional.py" == short_path(
        "/opt/venv/lib/python3.11/site-packages/torch/nn/functional.py"
    )
    assert "threading.py" == short_path(textwrap.__file__.replace("textwrap", "threading"))
    assert "x.py" == short_path("/somewhere/else/x.py")
    assert "<string>" == short_path("<string>")


def _spawn_with_fault_file(
    started: list[ChildProcess], target: str, tmp_path: Path
) -> ChildProcess:
    child = spawn(f"{TARGETS}:{target}", role="worker", rank=2, fault_dir=str(tmp_path))
    started.append(child)
    child.wait_ready(time.monotonic() + 30)
    child.join(10.0)
    return child


def test_child_that_segfaults_is_described_by_signal_and_frame(
    started: list[ChildProcess], tmp_path: Path
) -> None:
    """A child dying of SIGSEGV: "died of SIGSEGV in <its innermost engine frame>", and
    the error of its death carries the signal, the frames and a client-safe location."""
    child = _spawn_with_fault_file(started, "ready_then_segfault", tmp_path)

    info = child.death_error(FailureCause.WORKER_DIED, child.name, child.name)

    assert -11 == child.exitcode
    assert (tmp_path / "fault-otel-worker-2").exists()
    assert "SIGSEGV" == info.signal
    assert ["string_at", "ready_then_segfault"] == [f.function for f in info.frames[:2]]
    assert "tests/ipc/targets.py" == info.frames[1].file
    assert info.location.startswith("died of SIGSEGV in child_main at otel_engine/ipc/process.py:")
    assert f"otel-worker-2 {info.location}" == info.message
    assert "WorkerDied" == info.type


def test_child_that_aborts_is_described_by_sigabrt(
    started: list[ChildProcess], tmp_path: Path
) -> None:
    """SIGABRT is a fault faulthandler reports too."""
    child = _spawn_with_fault_file(started, "ready_then_abort", tmp_path)

    assert child.describe_exit().startswith("died of SIGABRT in ")


def test_child_killed_by_sigkill_keeps_the_plain_description(
    started: list[ChildProcess], tmp_path: Path
) -> None:
    """SIGKILL leaves no report: "was killed by signal 9", no signal or location."""
    child = spawn(f"{TARGETS}:ready_and_wait", role="worker", rank=2, fault_dir=str(tmp_path))
    started.append(child)
    child.wait_ready(time.monotonic() + 30)
    child.kill()
    child.join(10.0)

    info = child.death_error(FailureCause.WORKER_DIED, child.name, child.name)

    assert ("otel-worker-2 was killed by signal 9", "", "") == (
        info.message,
        info.signal,
        info.location,
    )
