"""What a test needs of the CPU it runs on: an instruction-set level (`require_isa`), or
an emulated CPU without AVX-512 (`require_qemu`).

Where it is missing the test is skipped, except in CI (`CI` set, as `.ci/run` sets it): CI's
machine has AVX-512 BF16 and `.ci/run` installs qemu-user, so a missing one there fails
instead of skipping, and a path the matrix claims to cover cannot silently go untested.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

from otel_engine.model import kernels

CI_ENV = "CI"
QEMU = "qemu-x86_64"
# QEMU 7.2's Haswell: AVX2 and FMA (x86-64-v3), no AVX-512 (an AVX-512 instruction is SIGILL).
QEMU_CPU = "Haswell"


def missing(reason: str) -> NoReturn:
    """Skip for `reason`; in CI, fail for it."""
    if os.environ.get(CI_ENV):
        pytest.fail(f"{reason}, and {CI_ENV} is set: CI must run this test", pytrace=False)
    pytest.skip(reason)


def require_isa(level: str) -> None:
    """Go on only where this CPU runs a kernels build for `level` (one of
    `kernels.ISA_LEVELS`, as `kernels.cpu_isa()` reads the CPU)."""
    detected = kernels.cpu_isa()
    try:
        kernels.check_runnable(level, detected, source=f"kernels for {level}")
    except ValueError:
        missing(f"needs a CPU with {level}; this one runs {detected}")


def require_qemu() -> str:
    """The path of `qemu-x86_64` (Debian package qemu-user; `.ci/run` installs it)."""
    path = shutil.which(QEMU)
    if path is None:
        missing(f"{QEMU} is not installed (Debian package qemu-user)")
    return path
