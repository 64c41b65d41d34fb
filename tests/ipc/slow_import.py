"""A module that takes a while to import, as torch does (tests/ipc/test_process.py)."""

from __future__ import annotations

import time

time.sleep(2.0)
