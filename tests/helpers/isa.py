"""What a test needs of the machine it runs on: an instruction-set level (`require_isa`), an
emulated CPU without AVX-512 (`require_qemu`), or a tool (`missing`).

A level is a fact about the machine, not about the checkout: where the CPU lacks one, the
test is skipped, in CI too, and never failed for it (QEMU cannot emulate AVX-512, so no
machine without it can run those tests). The run's "CPU levels" summary
(`tests/helpers/cpu_levels.py`) names the levels tested natively, under QEMU and not at
all, so the gap is visible.

A tool is a fact about the install: in CI (`CI` set, as `.ci/run` sets it), which installs
qemu-user, Ray and vllm-router, a missing one fails instead of skipping, so that a path the
suite claims to cover cannot silently go untested. A host that is not x86-64 cannot run
this venv under `qemu-x86_64`: that is the machine again, a skip.
"""

from __future__ import annotations

import os
import platform
import shutil
from typing import NoReturn

import pytest

from otel_engine.model import kernels
from tests.helpers.cpu_levels import LEDGER, Coverage, LevelSkipped

CI_ENV = "CI"
QEMU = "qemu-x86_64"
# QEMU 7.2's Haswell: AVX2 and FMA (x86-64-v3), no AVX-512 (an AVX-512 instruction is SIGILL).
QEMU_CPU = "Haswell"
QEMU_ISA = "avx2"  # what `kernels.cpu_isa()` detects on it


def missing(reason: str) -> NoReturn:
    """Skip for a missing tool (`reason`); in CI, fail for it."""
    if os.environ.get(CI_ENV):
        pytest.fail(f"{reason}, and {CI_ENV} is set: CI must run this test", pytrace=False)
    pytest.skip(reason)


def require_isa(level: str) -> None:
    """Go on only where this CPU runs a kernels build for `level` (one of
    `kernels.ISA_LEVELS`, as `kernels.cpu_isa()` reads the CPU); else skip."""
    detected = kernels.cpu_isa()
    try:
        kernels.check_runnable(level, detected, source=f"kernels for {level}")
    except ValueError:
        reason = f"needs a CPU with {level}; this one runs {detected}"
        raise LevelSkipped(reason, level, Coverage.NATIVE) from None
    LEDGER.record_ran(level, Coverage.NATIVE)


def require_qemu() -> str:
    """The path of `qemu-x86_64` (Debian package qemu-user; `.ci/run` installs it), on an
    x86-64 host, to run this interpreter on QEMU's `QEMU_CPU` (level `QEMU_ISA`)."""
    if platform.machine() != "x86_64":
        reason = f"runs x86-64 builds under qemu; this host is {platform.machine()}"
        raise LevelSkipped(reason, QEMU_ISA, Coverage.QEMU)
    path = shutil.which(QEMU)
    if path is None:
        reason = f"{QEMU} is not installed (Debian package qemu-user)"
        if os.environ.get(CI_ENV):
            missing(reason)
        raise LevelSkipped(reason, QEMU_ISA, Coverage.QEMU)
    LEDGER.record_ran(QEMU_ISA, Coverage.QEMU)
    return path
