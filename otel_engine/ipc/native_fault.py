"""What a process leaves behind when native code kills it: `faulthandler`'s report.

Every child of the engine enables `faulthandler` first thing (`process.child_main`), writing
to its own file in the engine's private IPC directory. When the parent sees the child die of
a signal that faulthandler catches (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL), it reads the
file (`read_report`): the faulting thread's innermost frames, as file, line and function
only (paths from `otel_engine/`, site-packages or the standard library, never a machine's
install path). An engine that runs in the caller's process enables it on stderr instead
(`enable_on_stderr`), so a native fault at least leaves its stack there.
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
_FAULTING_THREAD = re.compile(
    r"^(Current thread 0x[0-9a-fA-F]+.*|Stack) \(most recent call first\)"
)
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+|\?+) in (?P<function>.*?)\s*$')

_fault_file: TextIO | None = None  # held open for as long as the process lives


@dataclass(frozen=True, slots=True)
class FaultReport:
    """A native fault: the signal ("SIGSEGV") and the faulting thread's frames, innermost
    first (empty when faulthandler wrote none)."""

    signal: str
    frames: tuple[StackFrame, ...] = ()

    def describe(self) -> str:
        """How the parent says it: "died of SIGSEGV in maybe_inject at otel_engine/...:123"."""
        where = location(self.frames)
        return f"died of {self.signal} in {where}" if where else f"died of {self.signal}"


def parse_report(text: str) -> FaultReport | None:
    """The signal and the innermost `MAX_FRAMES` frames of the faulting thread (the
    "Current thread ... (most recent call first)" block) of faulthandler's text; None when
    the text holds no report."""
    signal_name = ""
    frames: list[StackFrame] = []
    in_block = False
    for line in text.splitlines():
        if match := _FATAL.match(line):
            signal_name = _SIGNAL_NAMES.get(match["what"], "")
        elif _FAULTING_THREAD.match(line):
            in_block, frames = True, []
        elif in_block and (match := _FRAME.match(line)):
            if len(frames) < MAX_FRAMES:
                number = match["line"]
                frames.append(
                    StackFrame(
                        short_path(match["file"]),
                        int(number) if number.isdigit() else 0,
                        match["function"],
                    )
                )
        elif in_block and not line.startswith("  "):
            in_block = False
    if not signal_name and not frames:
        return None
    return FaultReport(signal_name, tuple(frames))


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
