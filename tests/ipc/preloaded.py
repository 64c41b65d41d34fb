"""A module a standby imports ahead (tests/ipc/test_process.py): it notes how it was imported."""

from __future__ import annotations

import os
import threading

THREAD = threading.current_thread().name  # of the thread that imports it
NICE = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
