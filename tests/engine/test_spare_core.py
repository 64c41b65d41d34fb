"""The spare engine core of a server that restarts its engine (`Frontend.next_client`)."""

from __future__ import annotations

import pytest

from otel_engine.config import EngineConfig
from otel_engine.engine.frontend import Frontend
from otel_engine.ipc.process import Standby

pytestmark = pytest.mark.slow  # starts engine processes


def test_a_spare_still_importing_is_not_used_a_fresh_process_is(tiny_model_dir: str) -> None:
    """A restart that finds the spare still importing closes it and starts the new engine
    core in a fresh process (`engine.spare_not_ready`); the next spare is started."""
    config = EngineConfig.from_kwargs(
        model=tiny_model_dir, on_engine_failure="restart", num_kv_blocks=64, multiprocess=True
    )
    frontend = Frontend(config)
    try:
        first = frontend._spare
        assert first is not None
        first.close()
        slow = Standby(preload=["tests.ipc.slow_import"])  # 2 s to import
        frontend._spare = slow
        old = frontend.client
        client = frontend.next_client(restarts=1)
        frontend.client = client
        old.shutdown()

        assert slow.popen.returncode is not None  # closed, never launched
        assert client.core.popen is not slow.popen
        assert client.max_model_len == old.max_model_len
        assert frontend._spare is not None
        assert frontend._spare is not slow
    finally:
        frontend.shutdown()
