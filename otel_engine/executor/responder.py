"""A worker's answer to "where are you?": a thread with its own ZMQ socket.

After a step timeout at TP > 1 the engine core asks every worker (`hang.ask_ranks`); each
worker's `responder` thread answers with a `RankReport` -- its Flight Recorder's last
collective, the step its busy loop is executing, and its main thread's stack as (file,
line, function) frames -- while the main thread stays wherever it is stuck (a collective,
an injected hang: both release the GIL). The responder never touches the model.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from types import FrameType
from typing import Any

import zmq

from otel_engine.ipc.codec import Codec
from otel_engine.ipc.messages import RankReport, StackFrame
from otel_engine.timing import MONITOR_JOIN_S, RESPONDER_POLL_S

logger = logging.getLogger(__name__)

# Collectives each worker's Flight Recorder keeps (TORCH_FR_BUFFER_SIZE): only the newest
# matters here, and a few steps' worth shows what led to it.
FLIGHT_RECORDER_ENTRIES = 64
MAX_FRAMES = 24  # innermost frames of the main thread's stack
_SITE_PACKAGES = f"{os.sep}site-packages{os.sep}"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flight_recorder_env() -> dict[str, str]:
    """The variables that turn PyTorch's Flight Recorder on in a worker (set before its
    process group exists); an operator's own setting wins."""
    return {
        "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE")
        or str(FLIGHT_RECORDER_ENTRIES)
    }


class Responder:
    """Thread `responder`: answers the core's `ask_ranks` on a REP socket bound at
    `address`. `step_id` is set by the busy loop around each step."""

    def __init__(self, rank: int, address: str, node: str = "") -> None:
        self.rank = rank
        self.node = node
        self.step_id: int | None = None
        self._main_ident = threading.main_thread().ident
        self._stop = threading.Event()
        self._context = zmq.Context(io_threads=1)
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        # where it listens: `address` itself, or the port a tcp://HOST:* bind picked
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="responder", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        codec: Codec[RankReport] = Codec(RankReport)
        try:
            while not self._stop.is_set():
                if not self._socket.poll(int(1000 * RESPONDER_POLL_S)):
                    continue
                self._socket.recv()
                self._socket.send(codec.encode(self.report()))
        except zmq.ZMQError:
            return  # closed under us at exit
        except Exception:
            logger.exception("worker.responder_failed", extra={"rank": self.rank})

    def watch(self, thread_ident: int) -> None:
        """Report the stack of this thread (the busy loop's) instead of the main thread's."""
        self._main_ident = thread_ident

    def report(self) -> RankReport:
        enqueued, completed, name = _last_collective()
        frame = sys._current_frames().get(self._main_ident or -1)
        return RankReport(
            rank=self.rank,
            step_id=self.step_id,
            last_enqueued_collective=enqueued,
            last_completed_collective=completed,
            last_collective=name,
            stack=_frames(frame),
            node=self.node,
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=MONITOR_JOIN_S)
        self._socket.close(linger=0)
        self._context.term()


def _last_collective() -> tuple[int, int, str]:
    """(last enqueued, last completed, name of the newest) from the Flight Recorder of this
    process's default group; (-1, -1, "") when it records nothing."""
    torch = sys.modules.get("torch")  # a worker has it; importing it here would take seconds
    if torch is None:
        return -1, -1, ""
    try:
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
    except Exception:
        return -1, -1, ""
    status: dict[str, Any] = next(iter((trace.get("pg_status") or {}).values()), {})
    entries = trace.get("entries") or []
    name = str(entries[-1].get("profiling_name", "")) if entries else ""
    return (
        int(status.get("last_enqueued_collective", -1)),
        int(status.get("last_completed_collective", -1)),
        name,
    )


def _frames(frame: FrameType | None) -> list[StackFrame]:
    """The innermost `MAX_FRAMES` frames, outermost first, as file, line and function only
    (paths relative to this project's root or to site-packages)."""
    if frame is None:
        return []
    summary = traceback.StackSummary.extract(
        traceback.walk_stack(frame), limit=MAX_FRAMES, lookup_lines=False, capture_locals=False
    )
    frames = []
    for entry in reversed(summary):
        path = entry.filename
        if _SITE_PACKAGES in path:  # no machine's install path
            path = path.split(_SITE_PACKAGES, 1)[1]
        elif path.startswith(_PACKAGE_ROOT + os.sep):
            path = os.path.relpath(path, _PACKAGE_ROOT)
        frames.append(StackFrame(path, entry.lineno or 0, entry.name))
    return frames
