"""The uvicorn and h11 internals the connection layer relies on are checked at server start:
present in the pinned versions, and named when one goes missing."""

from __future__ import annotations

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from otel_engine.entrypoints.network import uvicorn_internals
from otel_engine.entrypoints.network.connections import ConnectionTable, protocol_class
from otel_engine.entrypoints.network.limits import ServerLimits
from otel_engine.observability.metrics import EngineMetrics


def test_the_installed_versions_are_the_pinned_ones_and_have_everything() -> None:
    installed = {"uvicorn": uvicorn.__version__, "h11": h11.__version__}

    assert uvicorn_internals.WRITTEN_AGAINST == installed
    assert [] == uvicorn_internals.missing()


def test_a_missing_hook_stops_the_server_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(H11Protocol, "pause_writing")

    with pytest.raises(uvicorn_internals.InternalsChanged, match=r"H11Protocol\.pause_writing"):
        protocol_class(ConnectionTable(ServerLimits(), EngineMetrics()))


def test_a_missing_h11_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(h11.Connection, "start_next_cycle")

    with pytest.raises(uvicorn_internals.InternalsChanged) as raised:
        uvicorn_internals.check()

    assert "h11.Connection.start_next_cycle" in str(raised.value)
    assert "written against uvicorn 0.55.0, h11 0.16.0" in str(raised.value)


def test_a_field_uvicorn_no_longer_sets_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "class H11Protocol:\n    def __init__(self):\n        self.conn = None\n"
    monkeypatch.setattr(uvicorn_internals.inspect, "getsource", lambda cls: source)

    assert "H11Protocol.cycle" in uvicorn_internals.missing()
    assert "H11Protocol.connections" in uvicorn_internals.missing()
