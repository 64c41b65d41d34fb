"""The crash dump: what the engine was doing when it died, without the prompts.

Three parts, each built on its own so that one failing cannot stop the others:
`scheduler_output` (the failing step's batch), `engine_config` and `system_stats`. The
engine core builds it; when the engine core itself dies of a signal, the front end builds
one from what it knows (`front_end_stats_part`), the rest marked `not_available`.
Redaction is by allowlist: an object is dumped only through the `__crash_dump__` policy
declared next to its type (`sched/request.py`, `sampling_params.py`, ...); a field the
policy does not name is left out and listed by name and type under `unlisted_fields`, so a
field added later stays redacted until someone decides otherwise. The dump is capped at
`MAX_DUMP_BYTES` (requests beyond the cap are counted, not listed) and never raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from otel_engine.timing import CRASH_FILE_WRITE_S
from otel_engine.version import __version__

MAX_DUMP_BYTES = 64 * 1024
MAX_LIST_ITEMS = 256  # block ids and other lists of safe numbers are cut here
MAX_FAULT_FRAMES = 10  # a native fault's innermost frames in the failure part

# Policies a type declares in `__crash_dump__ = {field: rule}`:
VALUE = "value"  # a number, bool, enum or identifier: dumped as is
COUNT = "count"  # a sequence: only its length (None stays None)
IS_SET = "is_set"  # only whether it holds something
NESTED = "nested"  # another object with its own policy (None stays None)
DIGEST = "digest"  # text: its size in bytes and a short SHA-256, never the text

Rule = str | Callable[[Any], Any]


def dump_object(obj: Any) -> dict[str, Any]:
    """`obj` through its type's `__crash_dump__` allowlist; unknown types are redacted whole."""
    policy: dict[str, Rule] | None = getattr(type(obj), "__crash_dump__", None)
    if policy is None:
        return {"redacted": type(obj).__name__}
    out: dict[str, Any] = {}
    unlisted: dict[str, str] = {}
    for name in _field_names(obj):
        try:
            value = getattr(obj, name)
        except Exception as exc:
            out[name] = {"error": _describe(exc)}
            continue
        rule = policy.get(name)
        if rule is None:
            unlisted[name] = type(value).__name__
            continue
        out[name] = _safe(functools.partial(_apply, rule, value))
    if unlisted:
        out["unlisted_fields"] = unlisted
    return out


def _apply(rule: Rule, value: Any) -> Any:
    if callable(rule):
        return rule(value)
    if rule == VALUE:
        return _scalar(value)
    if rule == COUNT:
        return None if value is None else len(value)
    if rule == IS_SET:
        return bool(value) if not isinstance(value, (int, float)) else True
    if rule == NESTED:
        return None if value is None else dump_object(value)
    if rule == DIGEST:
        data = str(value).encode("utf-8", "surrogatepass")
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
    raise ValueError(f"unknown dump rule {rule!r}")


def _scalar(value: Any) -> Any:
    """Numbers, bools, None, enums and short ids as is; lists of numbers cut to a bound."""
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value[:128]
    if isinstance(value, list | tuple):
        items = [v for v in value[:MAX_LIST_ITEMS] if isinstance(v, int | float)]
        return items if len(value) <= MAX_LIST_ITEMS else {"first": items, "total": len(value)}
    return {"redacted": type(value).__name__}


def _field_names(obj: Any) -> list[str]:
    try:
        return _list_fields(obj)
    except Exception:
        return []


def _list_fields(obj: Any) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    struct_fields = getattr(type(obj), "__struct_fields__", None)
    if struct_fields is not None:
        return list(struct_fields)
    slots: Iterable[str] = getattr(type(obj), "__slots__", ())
    return [s for s in slots if not s.startswith("_")] or [
        k for k in vars(obj) if not k.startswith("_")
    ]


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception:
        return type(exc).__name__


def _safe(build: Callable[[], Any]) -> Any:
    """Run one part of the dump; its failure becomes a note, never an exception."""
    try:
        return build()
    except Exception as exc:
        return {"error": _describe(exc)}


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# ---- the three parts --------------------------------------------------------------------


def scheduler_output_part(
    step: Any, model_input: Any = None, device: str = "cpu"
) -> dict[str, Any]:
    """The failing step's batch: per request its safe fields, plus totals and tensor shapes."""
    result = _safe(lambda: _scheduler_output(step, model_input, device))
    return result if isinstance(result, dict) else {"error": "unexpected result"}


def _scheduler_output(step: Any, model_input: Any, device: str) -> dict[str, Any]:
    if step is None:
        return {"step_id": None, "requests": [], "note": "no step was running"}
    chunks = list(step.chunks)
    requests = []
    budget = MAX_DUMP_BYTES // 2
    used = 0
    for chunk in chunks:
        entry = _safe(functools.partial(_chunk, chunk))
        size = len(to_json(entry))
        if used + size > budget:
            break
        used += size
        requests.append(entry)
    part: dict[str, Any] = {
        "step_id": _scalar(step.step_id),
        "num_requests": len(chunks),
        "num_scheduled_tokens": sum(c.num_tokens for c in chunks),
        "num_prefill_chunks": sum(1 for c in chunks if c.num_tokens > 1),
        "preempted_request_ids": [
            str(r)[:128] for r in list(step.preempted_request_ids)[:MAX_LIST_ITEMS]
        ],
        "requests": requests,
        "num_omitted_requests": len(chunks) - len(requests),
    }
    if model_input is not None:
        part["tensors"] = _safe(lambda: _tensor_shapes(model_input, device))
    return part


# What a dumped request says of its chunk in the failing step, beside its own fields
# (`otel-engine replay` reads them back).
CHUNK_START, CHUNK_TOKENS = "scheduled_start", "num_scheduled_tokens"


def _chunk(chunk: Any) -> dict[str, Any]:
    entry = dump_object(chunk.request)
    entry[CHUNK_START] = chunk.start
    entry[CHUNK_TOKENS] = chunk.num_tokens
    entry["num_blocks"] = len(chunk.request.block_ids)
    return entry


def _tensor_shapes(model_input: Any, device: str) -> dict[str, Any]:
    """The step's tensors as shape/dtype/device only (never their contents)."""
    num_tokens = len(model_input.input_ids)
    num_seqs = len(model_input.query_lens)
    max_blocks = max((len(t) for t in model_input.block_tables), default=0)
    return {
        "input_ids": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "positions": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "slot_mapping": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "block_tables": {"shape": [num_seqs, max_blocks], "dtype": "int64", "device": device},
        "num_decodes": model_input.num_decodes,
        "num_sampled": len(model_input.sample_indices),
    }


def engine_config_part(
    config: Any, arch: Any = None, limits: Any = None, fast_paths: Any = None
) -> dict[str, Any]:
    """Model, dtype, device, parallelism, cache and scheduler limits, timeouts, versions, and
    the fast paths the model runs (`FastPaths.summary()`: levels, booleans and reasons)."""
    model = config.model
    part: dict[str, Any] = {
        "model": os.path.basename(os.path.normpath(model.model)) if model.model else "default",
        "dtype": model.dtype,
        "device": model.device,
        "max_model_len": model.max_model_len,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "multiprocess": config.parallel.multiprocess,
        "block_size": config.cache.block_size,
        "num_kv_blocks": config.cache.num_kv_blocks,
        "kv_cache_memory_gib": config.cache.kv_cache_memory_gib,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "engine_ready_timeout_s": config.timeouts.engine_ready_timeout,
        "step_timeout_s": config.timeouts.step_timeout,
        "shutdown_timeout_s": config.timeouts.shutdown_timeout,
        "versions": _safe(_versions),
    }
    if fast_paths is not None:
        part["fast_paths"] = fast_paths
    if limits is not None:  # what the engine actually runs with, not only what was asked
        part["num_kv_blocks"] = limits.num_kv_blocks
        part["max_model_len"] = limits.max_model_len
    if arch is not None:
        part["architecture"] = arch.architecture
        part["num_layers"] = arch.num_hidden_layers
        part["num_attention_heads"] = arch.num_attention_heads
        part["num_kv_heads"] = arch.num_key_value_heads
        # the lambda: reading the attribute may fail too, inside _safe
        limits = _safe(lambda: arch.family_limits())  # noqa: PLW0108
        if isinstance(limits, dict) and "error" not in limits:
            part.update(limits)
        else:
            part["family_limits"] = limits
    return part


def _versions() -> dict[str, str]:
    """Read from the installed distributions: importing torch here would load it into the
    engine core process, which at TP > 1 runs no model."""
    import importlib.metadata

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "unknown"
    return {
        "otel_engine": __version__,
        "torch": torch_version,
        "python": platform.python_version(),
    }


def system_stats_part(
    *,
    scheduler: Any,
    started_at: float,
    last_step_at: float,
    failure: dict[str, Any],
    process_pids: dict[str, int | None],
) -> dict[str, Any]:
    """Scheduler state, uptime, process memory, CPU load, accelerator memory, the failure."""
    now = time.monotonic()
    part: dict[str, Any] = {
        "failure": failure,
        "num_running": _safe(lambda: scheduler.num_running),
        "num_waiting": _safe(lambda: scheduler.num_waiting),
        "kv_cache_usage": _safe(lambda: round(scheduler.allocator.usage, 4)),
        "num_free_kv_blocks": _safe(lambda: scheduler.allocator.num_free_blocks),
        "num_cached_kv_blocks": _safe(lambda: scheduler.allocator.num_cached_blocks),
        "prefix_cache_hit_rate": _safe(lambda: _rounded(scheduler.allocator.hit_rate)),
        "num_steps": _safe(lambda: scheduler.num_steps),
        "num_preemptions": _safe(lambda: scheduler.num_preemptions),
        "uptime_s": round(now - started_at, 3),
        "seconds_since_last_step": round(now - last_step_at, 3),
        "process_rss_mib": _safe(lambda: _rss(process_pids)),
        "cpu_count": os.cpu_count(),
        "load_average": _safe(lambda: [round(x, 2) for x in os.getloadavg()]),
        "accelerator_memory": _safe(_accelerator_memory),
    }
    return part


def not_available(why: str) -> dict[str, Any]:
    """A part the process building the dump cannot know (it died with another process)."""
    return {"not_available": why}


def front_end_stats_part(*, failure: dict[str, Any], started_at: float) -> dict[str, Any]:
    """`system_stats` as the front end sees it after the engine core died: the failure,
    its own uptime and process memory, and the machine's load."""
    return {
        "failure": failure,
        "scheduler": not_available("the engine core died with its scheduler state"),
        "uptime_s": round(time.monotonic() - started_at, 3),
        "process_rss_mib": _safe(lambda: _rss({"front_end": os.getpid()})),
        "cpu_count": os.cpu_count(),
        "load_average": _safe(lambda: [round(x, 2) for x in os.getloadavg()]),
    }


def _rss(process_pids: dict[str, int | None]) -> dict[str, Any]:
    import psutil

    out: dict[str, Any] = {}
    for name, pid in process_pids.items():
        if pid is None:
            continue
        try:
            out[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error as exc:
            out[name] = {"error": type(exc).__name__}
    return out


def _accelerator_memory() -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return {
        f"cuda:{i}": {
            "allocated_mib": round(torch.cuda.memory_allocated(i) / 2**20, 1),
            "reserved_mib": round(torch.cuda.memory_reserved(i) / 2**20, 1),
        }
        for i in range(torch.cuda.device_count())
    }


def build_dump(parts: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Build every part (a failing part becomes its error), then enforce the size cap."""
    started = time.perf_counter()
    dump: dict[str, Any] = {name: _safe(build) for name, build in parts.items()}
    dump["build_ms"] = round((time.perf_counter() - started) * 1000, 2)
    capped = _safe(lambda: cap(dump))
    return (
        capped
        if isinstance(capped, dict) and "error" not in capped
        else {
            "build_ms": dump["build_ms"],
            "error": capped.get("error") if isinstance(capped, dict) else "cap failed",
        }
    )


def cap(dump: dict[str, Any]) -> dict[str, Any]:
    """Fit the JSON in MAX_DUMP_BYTES: drop the oldest history steps first, then listed
    requests (both are counted), then replace the largest remaining part by its size."""
    dump = _sanitize(dump)
    scheduler_part = dump.get("scheduler_output")
    history = dump.get("history")
    while len(to_json(dump)) > MAX_DUMP_BYTES:
        steps = history.get("steps") if isinstance(history, dict) else None
        if steps and isinstance(history, dict):
            removed = max(1, len(steps) // 4)
            del steps[:removed]
            omitted = history.get("num_omitted_steps", 0)
            history["num_omitted_steps"] = (omitted if isinstance(omitted, int) else 0) + removed
            continue
        requests = scheduler_part.get("requests") if isinstance(scheduler_part, dict) else None
        if requests and isinstance(scheduler_part, dict):
            removed = max(1, len(requests) // 4)
            del requests[-removed:]
            omitted = scheduler_part.get("num_omitted_requests", 0)
            scheduler_part["num_omitted_requests"] = (
                omitted if isinstance(omitted, int) else 0
            ) + removed
            continue
        sizes = {k: len(to_json(v)) for k, v in dump.items()}
        largest = max(sizes, key=sizes.__getitem__)
        dump[largest] = {
            "truncated": f"{sizes[largest]} bytes exceeded the {MAX_DUMP_BYTES}-byte cap"
        }
    return dump


_MAX_DEPTH = 12


def _sanitize(value: Any, depth: int = 0) -> Any:  # noqa: PLR0911 (one return per JSON kind)
    """Plain JSON data only: string keys, finite numbers, bounded depth and size."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= _MAX_DEPTH:
        return "<too deep>"
    if isinstance(value, dict):
        return {
            str(k)[:128]: _sanitize(v, depth + 1) for k, v in list(value.items())[:MAX_LIST_ITEMS]
        }
    if isinstance(value, list | tuple):
        return [_sanitize(v, depth + 1) for v in list(value)[:MAX_LIST_ITEMS]]
    return f"<{type(value).__name__}>"


def to_json(value: Any) -> str:
    """Compact, strict JSON that never raises (anything odd is sanitized first)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False, default=_default)
    except Exception:
        try:
            return json.dumps(
                _sanitize(value), separators=(",", ":"), allow_nan=False, default=_default
            )
        except Exception as exc:
            return json.dumps({"error": _describe(exc)})


def _default(value: Any) -> str:
    return f"<{type(value).__name__}>"


# ---- delivery ---------------------------------------------------------------------------


def failure_of(info: Any) -> dict[str, Any]:
    """`failure_summary` of an `ErrorInfo`: how it failed read from its type ("died" or
    "timeout" for the causes without an exception, else "exception")."""
    from otel_engine.errors import FailureCause

    try:
        how = FailureCause(info.type).how
    except ValueError:  # an exception's own class name
        how = "exception"
    return failure_summary(
        info.process, info.type, info.message, how, signal=info.signal, frames=info.frames
    )


def failure_summary(
    process: str,
    error_type: str,
    message: str,
    how: str,
    *,
    signal: str = "",
    frames: Sequence[Any] = (),
) -> dict[str, Any]:
    """Which process/rank failed and how (exception, died, timeout); for a process that died
    of a native fault, the signal and the faulting thread's innermost frames (objects with
    `function`, `file` and `line`, innermost first: code locations, nothing else)."""
    rank = None
    tail = process.rsplit("-", 1)[-1]
    if process.startswith(("worker", "otel-worker")) and tail.isdigit():
        rank = int(tail)
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
            outcome["error"] = _describe(exc)

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
            logger.error("engine_crash_dump.failed", extra={"error": _describe(exc)})


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
        logger.error("engine_crash_dump.span_failed", extra={"error": _describe(exc)})
    extra = {
        "scheduler_output": dump.get("scheduler_output"),
        "engine_config": dump.get("engine_config"),
        "system_stats": dump.get("system_stats"),
        "history": dump.get("history"),
        "ranks": dump.get("ranks"),
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
