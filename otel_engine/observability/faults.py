"""Fault injection for tests and chaos drills: `OTEL_ENGINE_FAULT`.

`OTEL_ENGINE_FAULT="<where>:<kind>[:rank=R][:step=S][:when=KEY>=N][:phase=P][:restart=K]"`,
or several such faults separated by `;` (a chaos drill: a different fault in each engine a
recovering server starts, a poison request in all of them); at each place and step the first
fault of the list that matches fires. In one fault, where in {worker, engine_core}, kind a
`FaultKind`, phase in {run, load, draft} (draft: as the engine core's draft model proposes,
speculative decoding), and KEY in {num_requests, num_tokens} (scheduled in the
step) or prompt_len (the longest prompt of a request in the step): `when` fires at every
step whose batch is at least that large (with `step=` too: only at that step, if it is), so
`when=prompt_len>=N` fires each time a request with such a prompt is scheduled, a request
that kills the engine. `restart=K` fires only in the engine started after K restarts
(`--on-engine-failure restart`; 0: the first start), without it in every one. Read from the
environment by every process when it sets itself up (`configure()`: the spawn trampoline for
children, the engine's set-up in the caller's process), never at import, so a bad value (any
item of a list) is a clear startup error; nothing else can set it.

`segfault` is a real invalid memory access in native code (ctypes reads address 0), as a
broken kernel would make: the process dies of SIGSEGV, its faulthandler writes the stack.
The kernel faults (`KERNEL_FAULTS`) happen inside a compiled kernel, the kernels library's
`fault_drill`, called where the fault fires: SIGSEGV, SIGFPE or SIGBUS on an OpenMP worker
thread (`native_thread_*`) or on the calling thread (`kernel_*`).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from otel_engine.ipc.roles import ProcessRole

logger = logging.getLogger(__name__)

ENV_VAR = "OTEL_ENGINE_FAULT"
# How many times the engine was restarted before this process's engine started: set by the
# front end for the engine core it starts (`engine/recovery.py`), inherited by its workers.
RESTARTS_ENV_VAR = "OTEL_ENGINE_RESTARTS"
WHERE = (ProcessRole.WORKER, ProcessRole.ENGINE_CORE)  # the processes that run steps


class FaultKind(enum.StrEnum):
    """What the fault does (docs/operations.md, "The fault injector")."""

    RAISE = "raise"
    OOM = "oom"
    EXIT = "exit"
    HANG = "hang"
    SEGFAULT = "segfault"
    NATIVE_THREAD_SEGFAULT = "native_thread_segfault"
    NATIVE_THREAD_FPE = "native_thread_fpe"
    NATIVE_THREAD_BUS_ERROR = "native_thread_bus_error"
    KERNEL_SEGFAULT = "kernel_segfault"
    KERNEL_FPE = "kernel_fpe"
    KERNEL_BUS_ERROR = "kernel_bus_error"


class DrillSignal(enum.IntEnum):
    """`fault_drill`'s kind (cpu_kernels.c): what the kernel does wrong."""

    SIGSEGV = 1  # writes an invalid address
    SIGFPE = 2  # divides an integer by zero
    SIGBUS = 3  # reads `target`, a mapped page past its file's end


class DrillThread(enum.IntEnum):
    """`fault_drill`'s thread: which thread of its OpenMP region faults."""

    CALLER = 0  # the Python thread that called the kernel
    OPENMP_WORKER = 1  # a thread Python does not run


KERNEL_FAULTS: dict[FaultKind, tuple[DrillSignal, DrillThread]] = {
    FaultKind.NATIVE_THREAD_SEGFAULT: (DrillSignal.SIGSEGV, DrillThread.OPENMP_WORKER),
    FaultKind.NATIVE_THREAD_FPE: (DrillSignal.SIGFPE, DrillThread.OPENMP_WORKER),
    FaultKind.NATIVE_THREAD_BUS_ERROR: (DrillSignal.SIGBUS, DrillThread.OPENMP_WORKER),
    FaultKind.KERNEL_SEGFAULT: (DrillSignal.SIGSEGV, DrillThread.CALLER),
    FaultKind.KERNEL_FPE: (DrillSignal.SIGFPE, DrillThread.CALLER),
    FaultKind.KERNEL_BUS_ERROR: (DrillSignal.SIGBUS, DrillThread.CALLER),
}
KINDS = tuple(FaultKind)


class FaultPhase(enum.StrEnum):
    """When in a process's life the fault fires."""

    RUN = "run"  # in a step (its number and shape: `step`, `when`)
    LOAD = "load"  # while the process loads the model, before it is ready
    # in a step, as speculative decoding's draft model proposes (engine_core only; its
    # number and the shape of the draft's forward: `step`, `when`)
    DRAFT = "draft"


WHEN_KEYS = ("num_requests", "num_tokens", "prompt_len")


class InjectedFault(RuntimeError):
    """The error raised by `kind=raise`."""


class InjectedOutOfMemoryError(RuntimeError):
    """The error raised by `kind=oom`: named like torch.OutOfMemoryError, no device needed."""


@dataclass(frozen=True, slots=True)
class Fault:
    where: ProcessRole
    kind: FaultKind
    rank: int = 0
    step: int | None = 1  # None: any step (with `when`)
    phase: FaultPhase = FaultPhase.RUN
    when: tuple[str, int] | None = None  # (KEY, N): the step's KEY >= N
    restart: int | None = None  # only in the engine started after this many restarts

    def matches(self, step: int, num_requests: int, num_tokens: int, prompt_len: int) -> bool:
        """Whether a run-phase step of this shape fires the fault."""
        if self.step is not None and self.step != step:
            return False
        if self.when is None:
            return True
        key, minimum = self.when
        shape = {"num_requests": num_requests, "num_tokens": num_tokens, "prompt_len": prompt_len}
        return shape[key] >= minimum

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if len(parts) < len(("where", "kind")) or parts[0] not in WHERE or parts[1] not in KINDS:
            raise ValueError(
                f"{ENV_VAR}={text!r}: expected <{'|'.join(WHERE)}>:<{'|'.join(KINDS)}>[:key=value]"
            )
        options: dict[str, str] = {}
        for part in parts[2:]:
            key, _, value = part.partition("=")
            if key not in ("rank", "step", "phase", "when", "restart") or not value:
                raise ValueError(f"{ENV_VAR}={text!r}: unknown option {part!r}")
            options[key] = value
        phase = options.get("phase", FaultPhase.RUN)
        if phase not in {p.value for p in FaultPhase}:
            raise ValueError(f"{ENV_VAR}={text!r}: phase must be one of {', '.join(FaultPhase)}")
        when = None
        if "when" in options:
            key, _, minimum = options["when"].partition(">=")
            if key not in WHEN_KEYS or not minimum.isdigit():
                raise ValueError(f"{ENV_VAR}={text!r}: when must be <{'|'.join(WHEN_KEYS)}>>=N")
            when = (key, int(minimum))
        for key in ("rank", "step", "restart"):
            if not options.get(key, "0").isdigit():
                raise ValueError(f"{ENV_VAR}={text!r}: {key} must be a whole number")
        step = int(options["step"]) if "step" in options else (None if when else 1)
        restart = int(options["restart"]) if "restart" in options else None
        return cls(
            ProcessRole(parts[0]),
            FaultKind(parts[1]),
            int(options.get("rank", 0)),
            step,
            FaultPhase(phase),
            when,
            restart,
        )

    @classmethod
    def parse_list(cls, text: str) -> tuple[Fault, ...]:
        """Faults separated by `;` (one fault: a list of one); an empty item is refused."""
        items = [item.strip() for item in text.split(";")]
        if not all(items):
            raise ValueError(f"{ENV_VAR}={text!r}: an empty fault in a `;`-separated list")
        return tuple(cls.parse(item) for item in items)


def configured_faults() -> tuple[Fault, ...]:
    text = os.environ.get(ENV_VAR, "").strip()
    return Fault.parse_list(text) if text else ()


def configure() -> tuple[Fault, ...]:
    """Read `OTEL_ENGINE_FAULT` for this process (ValueError naming it when malformed),
    keeping the faults of this engine: those for another of its restarts (`restart=K`) are
    left out."""
    global _FAULTS
    restarts = os.environ.get(RESTARTS_ENV_VAR, "0")
    _FAULTS = tuple(
        fault
        for fault in configured_faults()
        if fault.restart is None or str(fault.restart) == restarts
    )
    return _FAULTS


def wants_prompt_len() -> bool:
    """Whether a fault of this process fires by prompt length (`when=prompt_len>=N`): only
    then does a step find its longest prompt for it."""
    return any(fault.when is not None and fault.when[0] == "prompt_len" for fault in _FAULTS)


def maybe_inject(
    where: ProcessRole,
    *,
    phase: FaultPhase,
    rank: int = 0,
    step: int = 0,
    num_requests: int = 0,
    num_tokens: int = 0,
    prompt_len: int = 0,
) -> None:
    """Fire the first configured fault that matches this place (and, in a step, its number
    and shape); cheap when none is set."""
    fault = next(
        (
            fault
            for fault in _FAULTS
            if (fault.where, fault.phase, fault.rank) == (where, phase, rank)
            and (
                phase == FaultPhase.LOAD
                or fault.matches(step, num_requests, num_tokens, prompt_len)
            )
        ),
        None,
    )
    if fault is None:
        return
    logger.warning(
        "fault.injected", extra={"where": where, "kind": fault.kind, "rank": rank, "step": step}
    )
    if fault.kind is FaultKind.RAISE:
        raise InjectedFault(f"injected fault in {where} rank {rank} ({phase} step {step})")
    if fault.kind is FaultKind.OOM:
        raise InjectedOutOfMemoryError(f"injected out-of-memory in {where} rank {rank}")
    if fault.kind is FaultKind.EXIT:
        os._exit(137)
    if fault.kind is FaultKind.SEGFAULT:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if fault.kind in KERNEL_FAULTS:
        library, arguments = _kernel_drill(*KERNEL_FAULTS[fault.kind])
        status = library.fault_drill(**arguments)  # the process dies here
        raise InjectedFault(f"fault_drill returned {status} without a {fault.kind}")
    while True:  # hang
        time.sleep(3600)


def _kernel_drill(signal: DrillSignal, thread: DrillThread) -> tuple[Any, dict[str, Any]]:
    """The kernels library and `fault_drill`'s arguments for this fault (InjectedFault when
    this process has no kernels library to fault in)."""
    from otel_engine.model import kernels  # torch: only in a process that drills a kernel

    library = kernels.load(kernels.target_isa())  # the one the model loaded: never a rebuild
    if library is None:
        raise InjectedFault("no compiled kernels library to inject a kernel fault into")
    target = _unbacked_page() if signal is DrillSignal.SIGBUS else None
    return library, {"kind": int(signal), "thread": int(thread), "target": target}


def _unbacked_page() -> int:
    """The address of a mapped page past its file's end: reading it is SIGBUS. The mapping
    lives as long as the process."""
    size = 2 * mmap.PAGESIZE
    with tempfile.TemporaryFile(prefix="otel-engine-fault-") as file:
        file.truncate(size)
        mapping = mmap.mmap(file.fileno(), size)
        file.truncate(0)
    view = ctypes.c_char.from_buffer(mapping)  # holds the mapping (and itself, below) open
    _KEPT.append(view)
    return ctypes.addressof(view) + mmap.PAGESIZE


_FAULTS: tuple[Fault, ...] = ()  # set by configure()
_KEPT: list[Any] = []  # what a drill's target address points into
