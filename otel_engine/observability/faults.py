"""Fault injection for tests and chaos drills: `OTEL_ENGINE_FAULT`.

`OTEL_ENGINE_FAULT="<where>:<kind>[:rank=R][:step=S][:when=KEY>=N][:phase=P]"` with where
in {worker, engine_core}, kind in {raise, oom, exit, hang, segfault}, phase in {run, load},
and KEY in {num_requests, num_tokens} (scheduled in the step): `when` fires at the first
step whose batch is at least that large (with `step=` too: only at that step, if it is). Read from
the environment by every process when it sets itself up (`configure()`: the spawn
trampoline for children, the engine's set-up in the caller's process), never at import, so a
bad value is a clear startup error; nothing else can set it.

`segfault` is a real invalid memory access in native code (ctypes reads address 0), as a
broken kernel would make: the process dies of SIGSEGV, its faulthandler writes the stack.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_VAR = "OTEL_ENGINE_FAULT"
WHERE = ("worker", "engine_core")
KINDS = ("raise", "oom", "exit", "hang", "segfault")
PHASES = ("run", "load")
WHEN_KEYS = ("num_requests", "num_tokens")


class InjectedFault(RuntimeError):
    """The error raised by `kind=raise`."""


class InjectedOutOfMemoryError(RuntimeError):
    """The error raised by `kind=oom`: named like torch.OutOfMemoryError, no device needed."""


@dataclass(frozen=True, slots=True)
class Fault:
    where: str
    kind: str
    rank: int = 0
    step: int | None = 1  # None: any step (with `when`)
    phase: str = "run"
    when: tuple[str, int] | None = None  # (KEY, N): the step's KEY >= N

    def matches(self, step: int, num_requests: int, num_tokens: int) -> bool:
        """Whether a run-phase step of this shape fires the fault."""
        if self.step is not None and self.step != step:
            return False
        if self.when is None:
            return True
        key, minimum = self.when
        return (num_requests if key == "num_requests" else num_tokens) >= minimum

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
            if key not in ("rank", "step", "phase", "when") or not value:
                raise ValueError(f"{ENV_VAR}={text!r}: unknown option {part!r}")
            options[key] = value
        phase = options.get("phase", "run")
        if phase not in PHASES:
            raise ValueError(f"{ENV_VAR}={text!r}: phase must be one of {PHASES}")
        when = None
        if "when" in options:
            key, _, minimum = options["when"].partition(">=")
            if key not in WHEN_KEYS or not minimum.isdigit():
                raise ValueError(f"{ENV_VAR}={text!r}: when must be <{'|'.join(WHEN_KEYS)}>>=N")
            when = (key, int(minimum))
        step = int(options["step"]) if "step" in options else (None if when else 1)
        return cls(parts[0], parts[1], int(options.get("rank", 0)), step, phase, when)


def configured_fault() -> Fault | None:
    text = os.environ.get(ENV_VAR, "").strip()
    return Fault.parse(text) if text else None


def configure() -> Fault | None:
    """Read `OTEL_ENGINE_FAULT` for this process (ValueError naming it when malformed)."""
    global _FAULT
    _FAULT = configured_fault()
    return _FAULT


def maybe_inject(
    where: str,
    *,
    phase: str,
    rank: int = 0,
    step: int = 0,
    num_requests: int = 0,
    num_tokens: int = 0,
) -> None:
    """Fire the configured fault if it matches this place (and, in a step, its number and
    shape); cheap when none is set."""
    fault = _FAULT
    if fault is None or fault.where != where or fault.phase != phase or fault.rank != rank:
        return
    if phase == "run" and not fault.matches(step, num_requests, num_tokens):
        return
    logger.warning(
        "fault.injected", extra={"where": where, "kind": fault.kind, "rank": rank, "step": step}
    )
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault in {where} rank {rank} ({phase} step {step})")
    if fault.kind == "oom":
        raise InjectedOutOfMemoryError(f"injected out-of-memory in {where} rank {rank}")
    if fault.kind == "exit":
        os._exit(137)
    if fault.kind == "segfault":
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    while True:  # hang
        time.sleep(3600)


_FAULT: Fault | None = None  # set by configure()
