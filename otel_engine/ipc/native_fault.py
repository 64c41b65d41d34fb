"""What a process leaves behind when native code kills it: `faulthandler`'s report.

Every child of the engine enables `faulthandler` first thing (`process.child_main`), writing
to its own file in the engine's private IPC directory. When the parent sees the child die of
a signal that faulthandler catches (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL), it reads the
file (`read_report`): the faulting thread's innermost frames, as file, line and function
only (paths from `otel_engine/`, site-packages or the standard library, never a machine's
install path). An engine that runs in the caller's process enables it on stderr instead
(`enable_on_stderr`), so a native fault at least leaves its stack there.

A signal on a thread Python does not run (an OpenMP worker of a compiled kernel) has no
Python frames of its own, and faulthandler marks no thread "current": the report then takes
the Python thread blocked in a kernel call, the one whose innermost frame is in
`model/kernels.py`, where every call into the kernels library goes through a wrapper named
after its C entry point. Either way the kernel is that frame's function and the place is
the first frame outside `kernels.py`.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sysconfig
from dataclasses import dataclass
from typing import TextIO

from otel_engine.ipc.messages import StackFrame

# The signals faulthandler reports; any other (SIGKILL) leaves no report.
FAULT_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}
)
MAX_FRAMES = 10  # innermost frames of the faulting thread kept
MAX_REPORT_BYTES = 256 * 1024
PACKAGE = "otel_engine"
KERNELS_FILE = f"{PACKAGE}/model/kernels.py"  # every call into the compiled kernels
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SITE_PACKAGES = f"{os.sep}site-packages{os.sep}"
_STDLIB = sysconfig.get_paths()["stdlib"]
_SIGNAL_NAMES = {  # faulthandler's "Fatal Python error: <what>"
    "Segmentation fault": "SIGSEGV",
    "Floating point exception": "SIGFPE",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}
_FATAL = re.compile(r"^Fatal Python error: (?P<what>.+?)\s*$")
# A thread's block: "Current thread 0x..." (or "Stack" without all_threads) is the thread
# the signal arrived on; "Thread 0x..." any other.
_THREAD = re.compile(
    r"^(?:(?P<current>Current thread 0x[0-9a-fA-F]+.*|Stack)|Thread 0x[0-9a-fA-F]+.*)"
    r" \(most recent call first\)"
)
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?+) in (?P<function>.*?)\s*$')

_fault_file: TextIO | None = None  # held open for as long as the process lives


@dataclass(frozen=True, slots=True)
class FaultReport:
    """A native fault: the signal ("SIGSEGV") and the faulting thread's frames, innermost
    first (empty when faulthandler wrote none). `is_native_thread`: the signal arrived on a
    thread Python does not run, and the frames are those of the Python thread that was
    blocked in a kernel call (empty when none was)."""

    signal: str
    frames: tuple[StackFrame, ...] = ()
    is_native_thread: bool = False

    @property
    def kernel(self) -> str:
        """The compiled kernel it faulted in: the function of the innermost frame when that
        frame is in `kernels.py` (its wrapper of the C entry point); "" otherwise."""
        return self.frames[0].function if self.frames and is_kernel_call(self.frames[0]) else ""

    def describe(self) -> str:
        """How the parent says it: "died of SIGSEGV in maybe_inject at otel_engine/...:123";
        in a kernel "died of SIGSEGV in kernel decode_attention_bf16, called from forward at
        otel_engine/...:45", with "on a non-Python thread" when an OpenMP worker faulted."""
        said = f"died of {self.signal}"
        if self.is_native_thread:
            said += " on a non-Python thread"
        callers = [f for f in self.frames if not is_kernel_call(f)]
        where = location(callers)
        if self.kernel:
            return f"{said} in kernel {self.kernel}" + (f", called from {where}" if where else "")
        return f"{said} in {where}" if where else said


def is_kernel_call(frame: StackFrame) -> bool:
    return frame.file == KERNELS_FILE


def parse_report(text: str) -> FaultReport | None:
    """The signal and the innermost `MAX_FRAMES` frames of the faulting thread (the
    "Current thread ... (most recent call first)" block) of faulthandler's text, or, when no
    block is current (a signal on a non-Python thread), of the thread blocked in a kernel
    call; None when the text holds no report."""
    signal_name = ""
    threads: list[tuple[bool, list[StackFrame]]] = []  # (is current, frames), in text order
    frames: list[StackFrame] | None = None  # the block being read
    for line in text.splitlines():
        if match := _FATAL.match(line):
            signal_name = _SIGNAL_NAMES.get(match["what"], "")
        elif match := _THREAD.match(line):
            frames = []
            threads.append((match["current"] is not None, frames))
        elif frames is not None and (match := _FRAME.match(line)):
            if len(frames) < MAX_FRAMES:
                number = match["line"]
                line_number = int(number) if number.isdigit() else 0
                frames.append(StackFrame(short_path(match["file"]), line_number, match["function"]))
        elif frames is not None and not line.startswith("  "):
            frames = None
    if not signal_name and not any(block for _, block in threads):
        return None
    current = next((block for is_current, block in threads if is_current), None)
    if current is not None or not threads:
        return FaultReport(signal_name, tuple(current or ()))
    blocked = next((block for _, block in threads if block and is_kernel_call(block[0])), [])
    return FaultReport(signal_name, tuple(blocked), is_native_thread=True)


def read_report(path: str) -> FaultReport | None:
    """`parse_report` of the file at `path`; None when it is missing or empty. Never raises."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return parse_report(file.read(MAX_REPORT_BYTES))
    except OSError:
        return None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def location(frames: tuple[StackFrame, ...] | list[StackFrame]) -> str:
    """The innermost frame inside this package (else the innermost frame) as
    "<function> at <file>:<line>"; "" without frames."""
    inside = [f for f in frames if f.file.startswith(PACKAGE + "/")]
    frame = inside[0] if inside else (frames[0] if frames else None)
    return "" if frame is None else f"{frame.function} at {frame.file}:{frame.line}"


def short_path(path: str) -> str:
    """`path` from site-packages, this project's root or the standard library; a file
    elsewhere by its name alone."""
    if _SITE_PACKAGES in path:
        return path.split(_SITE_PACKAGES, 1)[1]
    for root in (_PACKAGE_ROOT, _STDLIB):
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return os.path.basename(path) if os.path.isabs(path) else path


def enable_to_file(path: str) -> None:
    """Write this process's fault reports (every thread) to `path`, a new file of mode 0600;
    to stderr when it cannot be opened."""
    global _fault_file
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        faulthandler.enable(all_threads=True)
        return
    _fault_file = os.fdopen(fd, "w")
    faulthandler.enable(_fault_file, all_threads=True)


def enable_on_stderr() -> None:
    """Report native faults of this process (every thread) on stderr, unless its owner
    already set faulthandler up."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)
