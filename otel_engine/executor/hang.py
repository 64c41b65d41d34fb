"""Which rank hung: after a step timeout at TP > 1, ask every worker (`responder`) where it
is, and name the one that stopped.

The culprit is the rank that did not answer, else the one whose last collective is behind
the others' (it never reached the collective its peers wait in), else the one whose main
thread is outside torch.distributed while its peers are inside. The step-timeout error
then says "rank R hung in <function> at <file>:<line>", and the crash dump gets every
rank's answer (`ranks`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from otel_engine.config import EngineConfig
from otel_engine.errors import FailureCause
from otel_engine.ipc.codec import Codec
from otel_engine.ipc.messages import ErrorInfo, RankReport, StackFrame
from otel_engine.ipc.process import process_title
from otel_engine.ipc.roles import ProcessRole
from otel_engine.timing import RANK_REPORT_WAIT_S

_IN_COLLECTIVE = ("torch/distributed/",)


@dataclass(frozen=True, slots=True)
class HungRank:
    rank: int
    reason: str  # "no answer", "behind", "outside the collective"
    frame: StackFrame | None  # where its main thread is (innermost frame)


def ask_ranks(
    context: zmq.Context, addresses: Sequence[str], timeout_s: float = RANK_REPORT_WAIT_S
) -> list[RankReport | None]:
    """Every rank's `RankReport`, None for a rank that did not answer within `timeout_s`
    (all asked at once, one deadline). Never raises."""
    codec: Codec[RankReport] = Codec(RankReport)
    sockets: list[zmq.Socket] = []
    reports: list[RankReport | None] = [None] * len(addresses)
    try:
        poller = zmq.Poller()
        for address in addresses:
            socket = context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            socket.send(b"where")
            sockets.append(socket)
            poller.register(socket, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        waiting = dict(enumerate(sockets))
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            for rank, socket in list(waiting.items()):
                if socket in ready:
                    reports[rank] = _decode(codec, socket.recv())
                    del waiting[rank]
    except zmq.ZMQError:
        pass  # what was answered so far stands
    finally:
        for socket in sockets:
            socket.close(linger=0)
    return reports


def _decode(codec: Codec[RankReport], data: bytes) -> RankReport | None:
    try:
        return codec.decode(data)
    except msgspec.DecodeError:
        return None


def hung_rank(reports: Sequence[RankReport | None]) -> HungRank | None:
    """The rank that stopped, or None when the answers do not single one out."""
    if not reports:
        return None
    silent = [rank for rank, report in enumerate(reports) if report is None]
    if silent:
        return HungRank(silent[0], "no answer", None)
    answered = [r for r in reports if r is not None]
    enqueued = [r.last_enqueued_collective for r in answered]
    if min(enqueued) < max(enqueued):
        behind = min(answered, key=lambda r: (r.last_enqueued_collective, r.rank))
        return HungRank(behind.rank, "behind", _innermost(behind))
    outside = [r for r in answered if not _in_collective(r)]
    if len(outside) == 1 and len(answered) > 1:
        return HungRank(outside[0].rank, "outside the collective", _innermost(outside[0]))
    return None


def _innermost(report: RankReport) -> StackFrame | None:
    return report.stack[-1] if report.stack else None


def _in_collective(report: RankReport) -> bool:
    return any(marker in frame.file for frame in report.stack for marker in _IN_COLLECTIVE)


def hang_error(
    step_id: int, config: EngineConfig, process: str, reports: Sequence[RankReport | None]
) -> ErrorInfo:
    """The step-timeout error, naming the hung rank where the reports single one out."""
    timeout = config.timeouts.step_timeout
    stalled = f"step {step_id} made no progress in {timeout:g} s (see --step-timeout)"
    culprit = hung_rank(reports)
    if culprit is None:
        return ErrorInfo(type=FailureCause.STEP_TIMEOUT, message=stalled, process=process)
    report = reports[culprit.rank]
    rank = (
        f"rank {culprit.rank} on {report.node}"
        if report and report.node
        else f"rank {culprit.rank}"
    )
    if culprit.frame is None:
        where = f"{rank} hung and did not answer"
    else:
        frame = culprit.frame
        where = f"{rank} hung in {frame.function} at {frame.file}:{frame.line}"
    return ErrorInfo(
        type=FailureCause.STEP_TIMEOUT,
        message=f"{where}; {stalled}",
        process=process_title(ProcessRole.WORKER, culprit.rank),
        rank=culprit.rank,
        location=where,
    )


def ranks_part(reports: Sequence[RankReport | None]) -> list[dict[str, object]]:
    """Every rank's answer for the crash dump (`ranks`), `answered: false` for a silent one."""
    part: list[dict[str, object]] = []
    culprit = hung_rank(reports)
    for rank, report in enumerate(reports):
        if report is None:
            part.append({"rank": rank, "answered": False})
            continue
        entry: dict[str, object] = {"answered": True, **msgspec.to_builtins(report)}
        entry["stack"] = [f"{f.function} at {f.file}:{f.line}" for f in report.stack]
        if culprit is not None and culprit.rank == rank:
            entry["hung"] = culprit.reason
        part.append(entry)
    return part
