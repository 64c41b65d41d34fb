"""TEMPORARY debug loop (to be deleted)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.failures.conftest import wait_exit
from tests.failures.crowd import run_crowd


@pytest.mark.parametrize("i", range(int(os.environ.get("DBG_N", "10"))))
def test_loop(i, start_server):
    server, watch = start_server("--tensor-parallel-size", "1")
    target = watch.find("otel-engine-core")
    killed = []

    def kill():
        killed.append(time.time())
        os.kill(target.pid, signal.SIGKILL)

    results = asyncio.run(run_crowd(server.base_url, 4, on_flowing=kill))
    code = wait_exit(server, timeout=60)
    bad = False
    for n, r in enumerate(results):
        if r.error is None or r.transport_error or r.hung:
            bad = True
            print(f"BAD client {n} stream={r.is_stream} status={r.status} hung={r.hung} "
                  f"te={r.transport_error} ended-kill={(r.ended_at or 0) - killed[0]:.3f} "
                  f"nevents={len(r.events)} last={r.events[-3:] if r.is_stream else r.body}")
        else:
            print(f"ok client {n} stream={r.is_stream} ended-kill={r.ended_at - killed[0]:.3f} "
                  f"nevents={len(r.events)}")
    if bad:
        print(server.tail())
    assert not bad
    assert code == 1
