"""Child process targets for tests/ipc (each called as target(channel, *args))."""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def ready_and_wait(channel: Any) -> None:
    channel.ready()
    while True:
        time.sleep(0.05)


def ready_and_ignore_sigterm(channel: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready_and_wait(channel)


def fail_while_starting(channel: Any) -> None:
    raise ValueError("bad weights")


def die_while_starting(channel: Any) -> None:
    os._exit(3)


def never_ready(channel: Any) -> None:
    while True:
        time.sleep(0.05)


def ready_then_exit(channel: Any, code: int) -> None:
    channel.ready()
    time.sleep(0.2)
    os._exit(code)


def ready_then_segfault(channel: Any) -> None:
    import ctypes

    channel.ready()
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def ready_then_abort(channel: Any) -> None:
    channel.ready()
    os.abort()


def report_start(channel: Any, path: str) -> None:
    """Write how this child started (its preloaded module, priorities, environment)."""
    import json
    import sys
    import threading

    preloaded = sys.modules.get("tests.ipc.preloaded")
    facts = {
        "preloaded_by": getattr(preloaded, "THREAD", None),
        "preload_nice": getattr(preloaded, "NICE", None),
        "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
        "launch_env": os.environ.get("OTEL_ENGINE_TEST_LAUNCH"),
    }
    with open(path, "w") as file:
        json.dump(facts, file)
    channel.ready()
