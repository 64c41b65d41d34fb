"""A module a standby imports ahead (tests/ipc/test_process.py): it notes how it was imported."""

from __future__ import annotations

import os
import threading

SCHEDULER = os.sched_getscheduler(0)  # of the thread that imports it
THREAD = threading.current_thread().name
