"""The fault grammar of OTEL_ENGINE_FAULT, `when=` shape conditions included."""

from __future__ import annotations

import pytest

from otel_engine.observability.faults import Fault


def test_step_and_when_conditions() -> None:
    by_step = Fault.parse("worker:raise:rank=1:step=5")
    by_shape = Fault.parse("engine_core:oom:when=num_tokens>=64")
    both = Fault.parse("worker:raise:step=3:when=num_requests>=3")
    default = Fault.parse("engine_core:raise")

    assert (by_step.rank, by_step.step, by_step.when) == (1, 5, None)
    assert by_step.matches(5, 1, 1)
    assert not by_step.matches(4, 9, 999)
    assert by_shape.step is None
    assert by_shape.matches(17, 1, 64)
    assert not by_shape.matches(17, 9, 63)
    assert both.matches(3, 3, 1)
    assert not both.matches(3, 2, 1)
    assert not both.matches(4, 3, 1)
    assert default.matches(1, 0, 0)
    assert not default.matches(2, 0, 0)


@pytest.mark.parametrize(
    "text",
    [
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
