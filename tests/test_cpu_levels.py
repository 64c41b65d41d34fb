"""The "CPU levels" summary (tests/helpers/cpu_levels.py) and the rule of tests/helpers/isa.py:
a level the machine lacks is a skip that the summary counts as a gap, never a failure; a
missing qemu-x86_64 fails only in CI."""

from __future__ import annotations

import pytest

from otel_engine.model import kernels
from tests.helpers import isa
from tests.helpers.cpu_levels import Coverage, Ledger, LevelSkipped


def _skip(ledger: Ledger, nodeid: str, level: str, how: Coverage = Coverage.NATIVE) -> None:
    ledger.record_skipped(nodeid, LevelSkipped("reason", level, how))


def test_an_avx2_machine_reports_avx512_levels_as_untested() -> None:
    """AVX2 natively and under QEMU, baseline natively; both AVX-512 levels untested, each
    with the number of distinct tests skipped for it."""
    ledger = Ledger()
    ledger.record_ran("baseline", Coverage.NATIVE)
    ledger.record_ran("avx2", Coverage.QEMU)
    for nodeid in ("a", "b", "c", "c"):
        _skip(ledger, nodeid, "avx512bf16")
    _skip(ledger, "d", "avx512")

    report = ledger.report(every_test_runs=("avx2",))

    assert ("baseline", "avx2") == report.native
    assert ("avx2",) == report.emulated
    assert ("avx512", "avx512bf16") == report.untested
    assert [
        "tested natively: baseline, avx2",
        "tested under QEMU: avx2",
        "not tested at all: avx512 (1 skipped), avx512bf16 (3 skipped)",
    ] == report.lines()


def test_every_level_is_in_some_row_in_isa_order() -> None:
    """An AVX-512 BF16 machine that ran every level natively: nothing untested."""
    ledger = Ledger()
    for level in reversed(kernels.ISA_LEVELS):
        ledger.record_ran(level, Coverage.NATIVE)

    report = ledger.report()

    assert kernels.ISA_LEVELS == report.native
    assert () == report.untested
    assert "not tested at all: none" == report.lines()[-1]


def test_a_run_without_qemu_says_why_the_emulated_level_is_missing() -> None:
    ledger = Ledger()
    _skip(ledger, "emulated", isa.QEMU_ISA, Coverage.QEMU)

    report = ledger.report(every_test_runs=(isa.QEMU_ISA,))

    assert () == report.emulated
    assert f"tested under QEMU: none ({isa.QEMU_ISA}: 1 skipped)" == report.lines()[1]


def test_a_level_above_the_cpu_skips_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(isa.CI_ENV, "true")
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx2")

    with pytest.raises(LevelSkipped) as info:
        isa.require_isa("avx512bf16")

    assert ("avx512bf16", Coverage.NATIVE) == (info.value.level, info.value.how)


def test_a_level_the_cpu_runs_is_recorded_as_tested(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger()
    monkeypatch.setattr(isa, "LEDGER", ledger)
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx512")

    isa.require_isa("avx2")

    assert {("avx2", Coverage.NATIVE)} == ledger.ran


@pytest.mark.parametrize(("ci", "expected"), [("true", pytest.fail.Exception), ("", LevelSkipped)])
def test_a_missing_qemu_fails_only_in_ci(
    monkeypatch: pytest.MonkeyPatch, ci: str, expected: type[BaseException]
) -> None:
    monkeypatch.setenv(isa.CI_ENV, ci)
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa.shutil, "which", lambda name: None)

    with pytest.raises(expected, match=isa.QEMU):
        isa.require_qemu()


def test_a_host_that_is_not_x86_64_skips_the_emulated_tests_in_ci(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(isa.CI_ENV, "true")
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")

    with pytest.raises(LevelSkipped, match="aarch64"):
        isa.require_qemu()
