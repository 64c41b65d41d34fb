"""bench/grammar_abuse.py's reproductions: each abusive request distinct from the others (no
refusal list keyed by the schema catches them), each refused by the engine's grammar bounds
but the ones meant to fit inside them, and its server run from the checkout it is given.
No engine is started."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from otel_engine.engine.structured_output import check, from_response_format
from otel_engine.entrypoints.tools.plan import Function
from otel_engine.errors import ErrorCode, RequestError

BENCH = Path(__file__).resolve().parents[2] / "bench"
NUM_REQUESTS = 16


@pytest.fixture
def abuse(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("grammar_abuse")


def _checked(body: dict[str, Any]) -> None:
    """What the server checks of a body's grammars before it admits the request."""
    for tool in body.get("tools", []):
        function = tool["function"]
        Function(function["name"], None, function["parameters"]).check()
    if "response_format" in body:
        spec = from_response_format(body["response_format"])
        assert spec is not None
        check(spec)


def test_every_abusive_request_of_a_scenario_is_distinct(abuse: ModuleType) -> None:
    for name, scenario in abuse.SCENARIOS.items():
        bodies = {json.dumps(scenario(i, 40)[1], sort_keys=True) for i in range(NUM_REQUESTS)}
        assert NUM_REQUESTS == len(bodies), name


def test_the_reproductions_are_refused_and_the_accepted_ones_pass(abuse: ModuleType) -> None:
    for name, scenario in abuse.SCENARIOS.items():
        for index in range(NUM_REQUESTS):
            body = scenario(index, 40)[1]
            if name in abuse.ACCEPTED:
                _checked(body)
                continue
            with pytest.raises(RequestError) as raised:
                _checked(body)
            assert ErrorCode.GRAMMAR_LIMIT_EXCEEDED == raised.value.code, name


def test_the_server_runs_the_checkout_it_is_given(abuse: ModuleType, tmp_path: Path) -> None:
    env = abuse.server_env(tmp_path)
    assert str(tmp_path.resolve()) == env["PYTHONPATH"]
    assert "1" == env["PYTHONSAFEPATH"]  # the directory it starts in does not shadow it
    assert str(BENCH.parent) == abuse.server_env(None)["PYTHONPATH"]
