"""Delivering a crash dump: the failure summary, the span event and log line
(`engine_crash_dump`), and the `--crash-dump-dir` file, each on its own so that one failing
cannot stop the others; nothing here raises."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from otel_engine.observability.crash_dump import MAX_FAULT_FRAMES, to_json
from otel_engine.observability.redaction import describe_error
from otel_engine.timing import CRASH_FILE_WRITE_S


def failure_of(info: Any) -> dict[str, Any]:
    """`failure_summary` of an `ErrorInfo`: how it failed read from its type ("died" or
    "timeout" for the causes without an exception, else "exception")."""
    from otel_engine.errors import FailureCause

    try:
        how = FailureCause(info.type).how
    except ValueError:  # an exception's own class name
        how = "exception"
    return failure_summary(
        info.process,
        info.type,
        info.message,
        how,
        rank=info.rank,
        signal=info.signal,
        frames=info.frames,
    )


def failure_summary(
    process: str,
    error_type: str,
    message: str,
    how: str,
    *,
    rank: int | None = None,
    signal: str = "",
    frames: Sequence[Any] = (),
) -> dict[str, Any]:
    """Which process/rank failed and how (exception, died, timeout); for a process that died
    of a native fault, the signal and the faulting thread's innermost frames (objects with
    `function`, `file` and `line`, innermost first: code locations, nothing else)."""
    return {
        "process": process,
        "rank": rank,
        "type": error_type,
        "message": message[:500],
        "how": how,
        "signal": signal or None,
        "frames": [
            {"function": str(f.function)[:128], "file": str(f.file)[:256], "line": int(f.line)}
            for f in list(frames)[:MAX_FAULT_FRAMES]
        ],
    }


def write_dump_file(
    directory: str, dump: dict[str, Any], failure: dict[str, Any], config: Any, logger: Any
) -> str | None:
    """Write the dump, the failure and the whole engine config (what `replay` needs to
    rebuild the engine) to `directory`/crash-<utc time>-<pid>.json: a temp file of mode 0600
    renamed into place. Returns its path; None (logged) when it fails or takes longer than
    CRASH_FILE_WRITE_S (a hung file system must not hold the crash path). Never raises."""
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            now = time.time()
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{now % 1:.6f}"[1:]
            path = os.path.join(directory, f"crash-{stamp}Z-{os.getpid()}.json")
            fd, temp = tempfile.mkstemp(prefix=".crash-", suffix=".tmp", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as file:
                    file.write(to_json({**dump, "failure": failure, "engine": _config(config)}))
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            outcome["path"] = path
        except Exception as exc:
            outcome["error"] = describe_error(exc)

    thread = threading.Thread(target=write, name="crash-dump-file", daemon=True)
    thread.start()
    thread.join(CRASH_FILE_WRITE_S)
    if "path" in outcome:
        return str(outcome["path"])
    error = outcome.get("error", f"not written within {CRASH_FILE_WRITE_S} s")
    with contextlib.suppress(Exception):
        logger.error(
            "engine_crash_dump.file_failed", extra={"directory": directory, "error": error}
        )
    return None


def _config(config: Any) -> Any:
    """The engine config as plain data (its instance id left out: it names this run only)."""
    import msgspec

    data = msgspec.to_builtins(config)
    if isinstance(data, dict):
        data.pop("instance_id", None)
    return data


def deliver(
    dump: dict[str, Any], span: Any, failure: dict[str, Any], config: Any, logger: Any
) -> None:
    """Write the dump to --crash-dump-dir when one is set, then `report_crash` it. Never
    raises."""
    directory = config.observability.crash_dump_dir
    path = write_dump_file(directory, dump, failure, config, logger) if directory else None
    report_crash(dump, span, failure, logger, path)


def report_crash(
    dump: dict[str, Any],
    span: Any,
    failure: dict[str, Any],
    logger: Any,
    dump_path: str | None = None,
) -> None:
    """Deliver a dump: a span event `otel_engine.crash` (plus status ERROR) and one JSON
    log line `engine_crash_dump` (an OTLP log record too when log export is on), both in
    the failing step span's context, with `dump_path` when it was also written to a file.
    Never raises."""
    try:
        _report(dump, span, failure, logger, dump_path)
    except Exception as exc:  # the dumper must never turn a crash into a different crash
        with contextlib.suppress(Exception):
            logger.error("engine_crash_dump.failed", extra={"error": describe_error(exc)})


def _report(
    dump: dict[str, Any], span: Any, failure: dict[str, Any], logger: Any, dump_path: str | None
) -> None:
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    rank = failure.get("rank")
    reason = f"{failure.get('type')}: {failure.get('message')}"
    attributes = {
        "otel_engine.crash.scheduler_output": to_json(dump.get("scheduler_output")),
        "otel_engine.crash.engine_config": to_json(dump.get("engine_config")),
        "otel_engine.crash.system_stats": to_json(dump.get("system_stats")),
        "otel_engine.crash.history": to_json(dump.get("history")),
        "otel_engine.crash.failed_process": str(failure.get("process")),
        "otel_engine.crash.failed_rank": -1 if rank is None else rank,
        "otel_engine.crash.reason": reason,
    }
    if dump.get("ranks") is not None:
        attributes["otel_engine.crash.ranks"] = to_json(dump.get("ranks"))
    if dump.get("placement") is not None:  # ranks on a Ray cluster's nodes
        attributes["otel_engine.crash.placement"] = to_json(dump.get("placement"))
    if failure.get("signal"):
        attributes["otel_engine.crash.signal"] = str(failure.get("signal"))
        attributes["otel_engine.crash.frames"] = to_json(failure.get("frames"))
    if dump_path is not None:
        attributes["otel_engine.crash.dump_path"] = dump_path
    try:
        if span is not None and span.is_recording():
            span.add_event(
                "exception",
                {
                    "exception.type": str(failure.get("type")),
                    "exception.message": str(failure.get("message")),
                },
            )
            span.add_event("otel_engine.crash", attributes)
            span.set_status(Status(StatusCode.ERROR, str(failure.get("type"))))
    except Exception as exc:
        logger.error("engine_crash_dump.span_failed", extra={"error": describe_error(exc)})
    extra = {
        "scheduler_output": dump.get("scheduler_output"),
        "engine_config": dump.get("engine_config"),
        "system_stats": dump.get("system_stats"),
        "history": dump.get("history"),
        "ranks": dump.get("ranks"),
        "placement": dump.get("placement"),
        "failed_process": failure.get("process"),
        "failed_rank": rank,
        "reason": reason,
        "signal": failure.get("signal"),
        "frames": failure.get("frames"),
        "exception.type": failure.get("type"),
        "exception.message": failure.get("message"),
        "dump_build_ms": dump.get("build_ms"),
        "dump_path": dump_path,
    }
    try:
        with trace.use_span(span, end_on_exit=False):
            logger.critical("engine_crash_dump", extra=extra)
    except Exception:
        logger.critical("engine_crash_dump", extra=extra)
