"""The crash dump: what the engine was doing when it died, without the prompts.

Three parts, each built on its own so that one failing cannot stop the others:
`scheduler_output` (the failing step's batch), `engine_config` and `system_stats`. The
engine core builds it; when the engine core itself dies of a signal, the front end builds
one from what it knows (`front_end_stats_part`), the rest marked `not_available`.
Redaction is by allowlist (`observability/redaction.py`); delivery (span event, log line,
file) is `observability/crash_delivery.py`. The dump is capped at `MAX_DUMP_BYTES` (requests
beyond the cap are counted, not listed) and never raises.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

from otel_engine.config import Device
from otel_engine.observability.faults import RESTARTS_ENV_VAR
from otel_engine.observability.redaction import (
    MAX_LIST_ITEMS,
    describe_error,
    dump_object,
    safe,
    scalar,
)
from otel_engine.version import __version__

MAX_DUMP_BYTES = 64 * 1024


MAX_FAULT_FRAMES = 10  # a native fault's innermost frames in the failure part


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def scheduler_output_part(
    step: Any, model_input: Any = None, device: str = Device.CPU, *, kernels: bool = False
) -> dict[str, Any]:
    """The failing step's batch: per request its safe fields, plus totals and tensor shapes
    (`kernels`: the compiled kernels ran it, which take their block tables as int32)."""
    result = safe(lambda: _scheduler_output(step, model_input, device, kernels))
    return result if isinstance(result, dict) else {"error": "unexpected result"}


def _scheduler_output(
    step: Any, model_input: Any, device: str, kernels: bool = False
) -> dict[str, Any]:
    if step is None:
        return {"step_id": None, "requests": [], "note": "no step was running"}
    chunks = list(step.chunks)
    requests = []
    budget = MAX_DUMP_BYTES // 2
    used = 0
    for chunk in chunks:
        entry = safe(functools.partial(_chunk, chunk))
        size = len(to_json(entry))
        if used + size > budget:
            break
        used += size
        requests.append(entry)
    part: dict[str, Any] = {
        "step_id": scalar(step.step_id),
        "num_requests": len(chunks),
        "num_scheduled_tokens": sum(c.num_tokens for c in chunks),
        "num_prefill_chunks": sum(1 for c in chunks if c.num_tokens > len(c.draft_token_ids) + 1),
        "num_draft_tokens": sum(len(c.draft_token_ids) for c in chunks),
        "preempted_request_ids": [
            str(r)[:128] for r in list(step.preempted_request_ids)[:MAX_LIST_ITEMS]
        ],
        "requests": requests,
        "num_omitted_requests": len(chunks) - len(requests),
    }
    if model_input is not None:
        part["tensors"] = safe(lambda: _tensor_shapes(model_input, device, kernels))
    return part


# What a dumped request says of its chunk in the failing step, beside its own fields
# (`otel-engine replay` reads them back).
# `num_draft_tokens`: of the chunk's tokens, the proposed ones the step verified (their
# count: like every token id, never the values).
CHUNK_START, CHUNK_TOKENS = "scheduled_start", "num_scheduled_tokens"
CHUNK_DRAFTS = "num_draft_tokens"


def _chunk(chunk: Any) -> dict[str, Any]:
    entry = dump_object(chunk.request)
    entry[CHUNK_START] = chunk.start
    entry[CHUNK_TOKENS] = chunk.num_tokens
    entry[CHUNK_DRAFTS] = len(chunk.draft_token_ids)
    entry["num_blocks"] = len(chunk.request.block_ids)
    return entry


def _tensor_shapes(model_input: Any, device: str, kernels: bool = False) -> dict[str, Any]:
    """The step's tensors as shape/dtype/device only (never their contents). Block tables
    are int32 in the compiled kernels, int64 in torch's ops."""
    tables = "int32" if kernels else "int64"
    num_tokens = len(model_input.input_ids)
    num_seqs = len(model_input.query_lens)
    max_blocks = max((len(t) for t in model_input.block_tables), default=0)
    return {
        "input_ids": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "positions": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "slot_mapping": {"shape": [num_tokens], "dtype": "int64", "device": device},
        "block_tables": {"shape": [num_seqs, max_blocks], "dtype": tables, "device": device},
        "num_decodes": model_input.num_decodes,
        "num_sampled": len(model_input.sample_indices),
    }


def engine_config_part(
    config: Any, arch: Any = None, limits: Any = None, fast_paths: Any = None
) -> dict[str, Any]:
    """Model, dtype, device, parallelism, cache and scheduler limits, timeouts, versions, and
    the fast paths the model runs: each rank's plan and where the ranks differ
    (`executor/rank_plans.py`)."""
    model = config.model
    part: dict[str, Any] = {
        "model": os.path.basename(os.path.normpath(model.model)) if model.model else "default",
        "dtype": model.dtype,
        "device": model.device,
        "max_model_len": model.max_model_len,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "multiprocess": config.parallel.multiprocess,
        "distributed_executor_backend": config.parallel.distributed_executor_backend,
        "block_size": config.cache.block_size,
        "num_kv_blocks": config.cache.num_kv_blocks,
        "kv_cache_memory_gib": config.cache.kv_cache_memory_gib,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "engine_ready_timeout_s": config.timeouts.engine_ready_timeout,
        "step_timeout_s": config.timeouts.step_timeout,
        "shutdown_timeout_s": config.timeouts.shutdown_timeout,
        "on_engine_failure": config.recovery.on_engine_failure,
        "max_engine_restarts": config.recovery.max_engine_restarts,
        "engine_restart_window_s": config.recovery.engine_restart_window,
        "speculative": _speculative(config.speculative),
        "versions": safe(_versions),
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
        limits = safe(lambda: arch.family_limits())  # noqa: PLW0108
        if isinstance(limits, dict) and "error" not in limits:
            part.update(limits)
        else:
            part["family_limits"] = limits
    return part


def _speculative(spec: Any) -> dict[str, Any] | None:
    """Speculative decoding's settings (None: off); the draft model by its file's name."""
    if spec.speculative_method is None:
        return None
    draft = spec.speculative_model
    return {
        "method": spec.speculative_method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "ngram_min": spec.ngram_min,
        "ngram_max": spec.ngram_max,
        "draft_model": os.path.basename(os.path.normpath(draft)) if draft else None,
    }


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
    memory_bandwidth: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Scheduler state, uptime, process memory, CPU load, accelerator memory, the failure,
    and the memory read bandwidth: the measured peak and the recent decode-only steps'
    (`DecodeBandwidth.part()`)."""
    now = time.monotonic()
    part: dict[str, Any] = {
        "failure": failure,
        "num_running": safe(lambda: scheduler.num_running),
        "num_waiting": safe(lambda: scheduler.num_waiting),
        "kv_cache_usage": safe(lambda: round(scheduler.allocator.usage, 4)),
        "num_free_kv_blocks": safe(lambda: scheduler.allocator.num_free_blocks),
        "num_cached_kv_blocks": safe(lambda: scheduler.allocator.num_cached_blocks),
        "prefix_cache_hit_rate": safe(lambda: _rounded(scheduler.allocator.hit_rate)),
        "num_steps": safe(lambda: scheduler.num_steps),
        "num_preemptions": safe(lambda: scheduler.num_preemptions),
        "uptime_s": round(now - started_at, 3),
        "seconds_since_last_step": round(now - last_step_at, 3),
        "process_rss_mib": safe(lambda: _rss(process_pids)),
        "cpu_count": os.cpu_count(),
        "load_average": safe(lambda: [round(x, 2) for x in os.getloadavg()]),
        "accelerator_memory": safe(_accelerator_memory),
        "memory_bandwidth": memory_bandwidth,
        "engine_restarts": engine_restarts(),
    }
    return part


def engine_restarts() -> int:
    """How many times the server restarted its engine before this one started
    (`--on-engine-failure restart`), as the front end told the engine core it started."""
    value = os.environ.get(RESTARTS_ENV_VAR, "0")
    return int(value) if value.isdigit() else 0


def not_available(why: str) -> dict[str, Any]:
    """A part the process building the dump cannot know (it died with another process)."""
    return {"not_available": why}


def front_end_stats_part(
    *,
    failure: dict[str, Any],
    started_at: float,
    memory_bandwidth: dict[str, Any] | None = None,
    engine_restarts: int = 0,
) -> dict[str, Any]:
    """`system_stats` as the front end sees it after the engine core died: the failure,
    its own uptime and process memory, the machine's load, the memory read bandwidth
    (the peak and the recent decode-only steps the core reported), and how many times the
    engine was restarted before the one that died."""
    return {
        "failure": failure,
        "scheduler": not_available("the engine core died with its scheduler state"),
        "uptime_s": round(time.monotonic() - started_at, 3),
        "process_rss_mib": safe(lambda: _rss({"front_end": os.getpid()})),
        "cpu_count": os.cpu_count(),
        "load_average": safe(lambda: [round(x, 2) for x in os.getloadavg()]),
        "memory_bandwidth": memory_bandwidth,
        "engine_restarts": engine_restarts,
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
    dump: dict[str, Any] = {name: safe(build) for name, build in parts.items()}
    dump["build_ms"] = round((time.perf_counter() - started) * 1000, 2)
    capped = safe(lambda: cap(dump))
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
            return json.dumps({"error": describe_error(exc)})


def _default(value: Any) -> str:
    return f"<{type(value).__name__}>"
