"""The fault grammar of OTEL_ENGINE_FAULT, `when=` shape conditions and kernel faults
included."""

from __future__ import annotations

import pytest

from otel_engine.observability.faults import (
    KERNEL_FAULTS,
    DrillSignal,
    DrillThread,
    Fault,
    FaultKind,
)


def test_step_and_when_conditions() -> None:
    by_step = Fault.parse("worker:raise:rank=1:step=5")
    by_shape = Fault.parse("engine_core:oom:when=num_tokens>=64")
    both = Fault.parse("worker:raise:step=3:when=num_requests>=3")
    default = Fault.parse("engine_core:raise")

    assert (by_step.rank, by_step.step, by_step.when) == (1, 5, None)
    assert by_step.matches(5, 1, 1, 0)
    assert not by_step.matches(4, 9, 999, 0)
    assert by_shape.step is None
    assert by_shape.matches(17, 1, 64, 0)
    assert not by_shape.matches(17, 9, 63, 0)
    assert both.matches(3, 3, 1, 0)
    assert not both.matches(3, 2, 1, 0)
    assert not both.matches(4, 3, 1, 0)
    assert default.matches(1, 0, 0, 0)
    assert not default.matches(2, 0, 0, 0)


def test_a_request_shaped_trigger_fires_at_every_step_that_schedules_a_long_prompt() -> None:
    poison = Fault.parse("worker:segfault:when=prompt_len>=100")

    assert (poison.step, poison.when, poison.restart) == (None, ("prompt_len", 100), None)
    assert poison.matches(1, 4, 300, 100)
    assert poison.matches(57, 1, 1, 250)  # a decode step of that request fires it again
    assert not poison.matches(2, 32, 2048, 99)


def test_restart_option_keeps_a_fault_to_one_engine_of_a_recovering_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`restart=K` fires in the engine started after K restarts only; without it, a fault
    fires in every engine the server starts."""
    from otel_engine.observability import faults

    monkeypatch.setenv(faults.ENV_VAR, "engine_core:raise:step=3:restart=1")
    monkeypatch.delenv(faults.RESTARTS_ENV_VAR, raising=False)
    assert () == faults.configure()  # the first engine
    monkeypatch.setenv(faults.RESTARTS_ENV_VAR, "1")
    (fault,) = faults.configure()
    assert (fault.step, fault.restart) == (3, 1)
    monkeypatch.setenv(faults.RESTARTS_ENV_VAR, "2")
    assert () == faults.configure()
    monkeypatch.setenv(faults.ENV_VAR, "engine_core:raise:step=3")
    assert 1 == len(faults.configure())  # every engine
    monkeypatch.delenv(faults.ENV_VAR)
    assert () == faults.configure()


def test_a_list_of_faults_keeps_those_of_this_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`;` separates faults: each engine of a recovering server keeps those for its restart
    count and those without one (a poison request, in every engine)."""
    from otel_engine.observability import faults

    monkeypatch.setenv(
        faults.ENV_VAR,
        "engine_core:raise:step=5:restart=0; worker:exit:step=9:restart=1;"
        "worker:raise:when=prompt_len>=100",
    )
    monkeypatch.delenv(faults.RESTARTS_ENV_VAR, raising=False)
    first = faults.configure()
    monkeypatch.setenv(faults.RESTARTS_ENV_VAR, "1")
    second = faults.configure()
    monkeypatch.setenv(faults.RESTARTS_ENV_VAR, "2")
    third = faults.configure()
    monkeypatch.delenv(faults.ENV_VAR)
    faults.configure()

    assert [("engine_core", "raise", 0), ("worker", "raise", None)] == [
        (f.where, f.kind, f.restart) for f in first
    ]
    assert [("worker", "exit", 1), ("worker", "raise", None)] == [
        (f.where, f.kind, f.restart) for f in second
    ]
    assert [("worker", "raise", None)] == [(f.where, f.kind, f.restart) for f in third]


def test_the_first_fault_of_a_list_that_matches_the_step_fires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from otel_engine.observability import faults

    monkeypatch.setattr(
        faults,
        "_FAULTS",
        Fault.parse_list("worker:oom:step=4;worker:raise:when=prompt_len>=100;worker:exit:step=4"),
    )

    faults.maybe_inject("worker", phase="run", step=3, prompt_len=99)  # none matches
    faults.maybe_inject("engine_core", phase="run", step=4)  # another place
    with pytest.raises(faults.InjectedOutOfMemoryError):
        faults.maybe_inject("worker", phase="run", step=4, prompt_len=100)
    with pytest.raises(faults.InjectedFault):
        faults.maybe_inject("worker", phase="run", step=5, prompt_len=100)
    assert faults.wants_prompt_len()


def test_a_step_finds_its_longest_prompt_only_for_a_fault_that_fires_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from otel_engine.observability import faults

    monkeypatch.delenv(faults.RESTARTS_ENV_VAR, raising=False)
    for text, wanted in (
        ("worker:segfault:when=prompt_len>=100", True),
        ("worker:segfault:when=num_tokens>=100", False),
        ("", False),
    ):
        monkeypatch.setenv(faults.ENV_VAR, text)
        faults.configure()
        assert wanted == faults.wants_prompt_len(), text
    monkeypatch.delenv(faults.ENV_VAR)
    faults.configure()


@pytest.mark.parametrize(
    "text",
    [
        "worker:raise:restart=first",
        "worker:raise:rank=-1",
        "worker:raise:when=num_blocks>=3",
        "worker:raise:when=num_tokens>3",
        "worker:raise:when=num_tokens>=x",
        "worker:explode",
        "worker:raise:color=red",
    ],
)
def test_malformed_faults_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="OTEL_ENGINE_FAULT"):
        Fault.parse(text)


@pytest.mark.parametrize(
    "text",
    [
        "worker:raise:step=3;worker:explode",
        "worker:raise:step=3;;worker:exit:step=4",
        "worker:raise:step=3;",
        ";",
    ],
)
def test_a_list_with_a_malformed_or_empty_fault_is_refused_whole(text: str) -> None:
    with pytest.raises(ValueError, match="OTEL_ENGINE_FAULT"):
        Fault.parse_list(text)


@pytest.mark.parametrize("where", ["worker", "engine_core"])
def test_kernel_faults_parse_to_a_signal_and_a_thread_of_fault_drill(where: str) -> None:
    """Each kernel fault kind names what `fault_drill` does and on which thread."""
    on_a_worker = Fault.parse(f"{where}:native_thread_segfault:rank=1:step=200")
    on_the_caller = Fault.parse(f"{where}:kernel_bus_error")

    assert (FaultKind.NATIVE_THREAD_SEGFAULT, 1, 200) == (
        on_a_worker.kind,
        on_a_worker.rank,
        on_a_worker.step,
    )
    assert (DrillSignal.SIGSEGV, DrillThread.OPENMP_WORKER) == KERNEL_FAULTS[on_a_worker.kind]
    assert (DrillSignal.SIGBUS, DrillThread.CALLER) == KERNEL_FAULTS[on_the_caller.kind]
    every = {(signal, thread) for signal in DrillSignal for thread in DrillThread}
    assert every == set(KERNEL_FAULTS.values())  # each once: no two kinds do the same
