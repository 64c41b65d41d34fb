"""Which CPU levels a test run covered: natively, under QEMU, or not at all (a pytest plugin,
loaded by tests/conftest.py).

`tests/helpers/isa.py` records here each level a test ran at and raises `LevelSkipped` for
a level the machine cannot run; the run ends with a "CPU levels" section that names the
levels of `kernels.ISA_LEVELS` tested each way, and how many tests each gap skipped, so a
level this machine cannot test shows as a gap instead of passing silently.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field

import pytest

from otel_engine.model import kernels


class Coverage(enum.Enum):
    """How a test runs a level: on this CPU, or on a CPU that QEMU emulates."""

    NATIVE = "natively"
    QEMU = "under QEMU"


class LevelSkipped(pytest.skip.Exception):  # type: ignore[name-defined]  # pytest's public name
    """A skip because this machine cannot run `level` the way the test needs (`how`)."""

    def __init__(self, reason: str, level: str, how: Coverage) -> None:
        super().__init__(reason, pytrace=False)
        self.level = level
        self.how = how


@dataclass(frozen=True, slots=True)
class LevelReport:
    """Each level of `kernels.ISA_LEVELS` in `native`, `emulated`, both, or `untested`;
    `skipped` counts the tests skipped for a level, by how they would have run it."""

    native: tuple[str, ...]
    emulated: tuple[str, ...]
    untested: tuple[str, ...]
    skipped: Counter[tuple[str, Coverage]]

    def lines(self) -> list[str]:
        qemu_gaps = [
            f"{level}: {count} skipped"
            for (level, how), count in self.skipped.items()
            if how is Coverage.QEMU and level not in self.emulated
        ]
        untested = [f"{level}{self._skips(level)}" for level in self.untested]
        return [
            f"tested natively: {', '.join(self.native) or 'none'}",
            f"tested under QEMU: {', '.join(self.emulated) or 'none'}"
            + (f" ({'; '.join(qemu_gaps)})" if qemu_gaps else ""),
            f"not tested at all: {', '.join(untested) or 'none'}",
        ]

    def _skips(self, level: str) -> str:
        count = sum(n for (skipped, _), n in self.skipped.items() if skipped == level)
        return f" ({count} skipped)" if count else ""


@dataclass(slots=True)
class Ledger:
    """What the tests of one run reported about levels."""

    ran: set[tuple[str, Coverage]] = field(default_factory=set)
    skipped: dict[tuple[str, Coverage], set[str]] = field(default_factory=dict)

    def record_ran(self, level: str, how: Coverage) -> None:
        self.ran.add((level, how))

    def record_skipped(self, nodeid: str, error: LevelSkipped) -> None:
        self.skipped.setdefault((error.level, error.how), set()).add(nodeid)

    def report(self, every_test_runs: tuple[str, ...] = ()) -> LevelReport:
        """The report, counting the levels in `every_test_runs` (this CPU's, the kernels')
        as tested natively."""
        native = {level for level, how in self.ran if how is Coverage.NATIVE}
        native.update(every_test_runs)
        emulated = {level for level, how in self.ran if how is Coverage.QEMU}
        levels = kernels.ISA_LEVELS
        return LevelReport(
            native=tuple(level for level in levels if level in native),
            emulated=tuple(level for level in levels if level in emulated),
            untested=tuple(level for level in levels if level not in native | emulated),
            skipped=Counter({key: len(nodeids) for key, nodeids in self.skipped.items()}),
        )


LEDGER = Ledger()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # a module-scoped fixture's skip is raised again, the same exception, for each of its tests
    if call.excinfo is not None and isinstance(call.excinfo.value, LevelSkipped):
        LEDGER.record_skipped(item.nodeid, call.excinfo.value)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not any(terminalreporter.stats.get(key) for key in ("passed", "failed", "error")):
        return
    cpu, kernels_isa = kernels.cpu_isa(), kernels.target_isa()
    every_test_runs = tuple({cpu, kernels_isa} & set(kernels.ISA_LEVELS))
    terminalreporter.section("CPU levels")
    terminalreporter.write_line(f"this CPU runs {cpu}; the kernels are built for {kernels_isa}")
    for line in LEDGER.report(every_test_runs).lines():
        terminalreporter.write_line(line)
