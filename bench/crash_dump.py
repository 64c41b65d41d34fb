"""Time and size of one crash dump with a full batch in flight.

    .venv/bin/python bench/crash_dump.py [--requests 256] [--repeat 50] [--json out.json]

For each case, a real `Scheduler` admits N requests (real `Request`s, random prompt token
ids, greedy `SamplingParams` with a stop string and a seed), prefills them all in one step,
samples one token each, and schedules the next step: a decode batch of N requests that hold
every KV block of their prompt. That step, its `ModelInput`, a real `EngineConfig` and the
scheduler's state are what `EngineCore.record_crash` hands to the dumper. Measured:

- build: `crash_dump.build_dump` of the four parts (scheduler output with tensor shapes,
  engine config, system stats, a full 64-step history), the size cap included, as the engine
  core calls it;
- report: `crash_delivery.report_crash` on a real SDK span (in-memory exporter) and a logger
  rendering the JSON line through the real pipeline into memory;
- the dump's JSON size next to `MAX_DUMP_BYTES`, and how many requests it lists / omits.

The first build of the process is reported apart (cold caches, lazy imports). The target is
a build under 50 ms; numbers only, nothing is asserted.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import prepare_model_input
from otel_engine.observability import crash_delivery, crash_dump
from otel_engine.observability.log_render import (
    PipelineFormatter,
    remove_meta,
    render_json,
    structure_exception,
)
from otel_engine.observability.logging import shared_processors
from otel_engine.observability.step_history import StepHistory
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.kv_cache import BlockAllocator, num_blocks_for
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import Scheduler

TARGET_MS = 50.0
VOCAB_SIZE = 49152
SEED = 1234


@dataclass(frozen=True)
class Case:
    """One batch shape: prompt lengths drawn uniformly from [min_prompt, max_prompt]."""

    name: str
    min_prompt: int
    max_prompt: int
    block_size: int


CASES = [
    Case("prompts 128-2048, block 16", 128, 2048, 16),
    Case("prompts 1600-2048, block 16 (100+ blocks each)", 1600, 2048, 16),
    Case("prompts 128-2048, block 8 (16-256 blocks)", 128, 2048, 8),
]


def decode_batch(case: Case, num_requests: int) -> tuple[Scheduler, Any, Any]:
    """A scheduler whose next step decodes `num_requests` fully prefilled requests."""
    rng = random.Random(SEED)
    lengths = [rng.randint(case.min_prompt, case.max_prompt) for _ in range(num_requests)]
    num_blocks = sum(num_blocks_for(n + 1, case.block_size) for n in lengths) + num_requests
    scheduler = Scheduler(
        BlockAllocator(num_blocks, case.block_size),
        max_num_seqs=num_requests,
        max_num_batched_tokens=sum(lengths),
        max_model_len=4096,
    )
    params = SamplingParams(max_tokens=256, temperature=0.0, seed=7, stop=("a stop string",))
    for index, length in enumerate(lengths):
        prompt = [rng.randrange(1000, VOCAB_SIZE) for _ in range(length)]
        scheduler.add(Request(f"cmpl-{index:04d}-{rng.getrandbits(64):016x}", prompt, params))
    prefill = scheduler.schedule()
    scheduler.update(prefill, [rng.randrange(1000, VOCAB_SIZE) for _ in prefill.chunks])
    step = scheduler.schedule()
    model_input = prepare_model_input(step.step_id, step.chunks, case.block_size, {})
    return scheduler, step, model_input


def full_history(num_steps: int = 64) -> StepHistory:
    """The default 64 steps of history, full, with numbers of realistic width."""
    history = StepHistory(num_steps)
    now = time.time()
    for step in range(1, 1000):
        history.record(
            (step, now + step * 0.05, 0.0473912, 256, 3, 1024, 1, 0.8734, 12, 253, 40, 2)
        )
    return history


def dump_parts(case: Case, scheduler: Scheduler, step: Any, model_input: Any) -> dict[str, Any]:
    """The part builders, bound as `EngineCore.record_crash` binds them (a full history)."""
    config = EngineConfig.from_kwargs(
        model="/models/SmolLM2-135M-Instruct",
        tensor_parallel_size=2,
        block_size=case.block_size,
        num_kv_blocks=scheduler.allocator.num_blocks,
        max_num_seqs=len(step.chunks),
    )
    arch = load_model_arch_like()
    failure = crash_delivery.failure_summary("worker-1", "RuntimeError", "bench", "exception")
    pids: dict[str, int | None] = {"engine_core": os.getpid(), "otel-worker-0": os.getpid()}
    started = time.monotonic() - 3600.0
    history = full_history()
    return {
        "scheduler_output": lambda: crash_dump.scheduler_output_part(step, model_input),
        "engine_config": lambda: crash_dump.engine_config_part(config, arch),
        "system_stats": lambda: crash_dump.system_stats_part(
            scheduler=scheduler,
            started_at=started,
            last_step_at=started,
            failure=failure,
            process_pids=pids,
        ),
        "history": history.part,
    }


def load_model_arch_like() -> Any:
    """The default model's architecture fields the config part reads."""
    return SimpleNamespace(
        architecture="LlamaForCausalLM",
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        family_limits=lambda: {"family": "llama", "sliding_window": None},
    )


def json_logger() -> logging.Logger:
    """A logger that renders through the real JSON pipeline into memory."""
    logger = logging.getLogger("bench.crash_dump")
    logger.propagate = False
    handler = logging.StreamHandler(io.StringIO())
    chain = shared_processors("engine_core", None, log_prompts=False)
    handler.setFormatter(PipelineFormatter(chain, [remove_meta, structure_exception, render_json]))
    logger.handlers[:] = [handler]
    return logger


def run_case(case: Case, num_requests: int, repeat: int) -> dict[str, Any]:
    scheduler, step, model_input = decode_batch(case, num_requests)
    parts = dump_parts(case, scheduler, step, model_input)
    blocks = [len(c.request.block_ids) for c in step.chunks]
    build_ms: list[float] = []
    for _ in range(repeat):
        started = time.perf_counter()
        dump = crash_dump.build_dump(parts)
        build_ms.append((time.perf_counter() - started) * 1000)
    text = crash_dump.to_json(dump)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("bench")
    logger = json_logger()
    failure = dump["system_stats"]["failure"]
    report_ms: list[float] = []
    for _ in range(repeat):
        span = tracer.start_span("engine_core.step")
        started = time.perf_counter()
        crash_delivery.report_crash(dump, span, failure, logger)
        report_ms.append((time.perf_counter() - started) * 1000)
        span.end()
    provider.shutdown()
    listed = dump["scheduler_output"]["requests"]
    return {
        "case": case.name,
        "num_requests": num_requests,
        "blocks_per_request": [min(blocks), max(blocks)],
        "dump_bytes": len(text.encode()),
        "num_listed": len(listed),
        "num_omitted": dump["scheduler_output"]["num_omitted_requests"],
        "build_ms": summary(build_ms),
        "report_ms": summary(report_ms),
    }


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "max": ordered[-1],
    }


def first_build_ms() -> float:
    """The process's first build (cold caches, lazy imports), on a two-request batch."""
    case = Case("tiny", 8, 8, 16)
    scheduler, step, model_input = decode_batch(case, 2)
    started = time.perf_counter()
    crash_dump.build_dump(dump_parts(case, scheduler, step, model_input))
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    first = first_build_ms()
    results = [run_case(case, args.requests, args.repeat) for case in CASES]
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, repeat {args.repeat}")
    print(f"first build in this process (2 requests): {first:.1f} ms")
    print(f"cap MAX_DUMP_BYTES = {crash_dump.MAX_DUMP_BYTES}; target build < {TARGET_MS:g} ms\n")
    header = ["case", "reqs", "blocks/req", "bytes", "listed", "omitted",
              "build ms p50", "p95", "max", "report ms p50", "p95"]  # fmt: skip
    rows = [
        [
            r["case"],
            str(r["num_requests"]),
            "{}-{}".format(*r["blocks_per_request"]),
            str(r["dump_bytes"]),
            str(r["num_listed"]),
            str(r["num_omitted"]),
            f"{r['build_ms']['median']:.2f}",
            f"{r['build_ms']['p95']:.2f}",
            f"{r['build_ms']['max']:.2f}",
            f"{r['report_ms']['median']:.2f}",
            f"{r['report_ms']['p95']:.2f}",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    worst = max(r["build_ms"]["p95"] for r in results)
    verdict = "within" if worst < TARGET_MS else "OVER"
    print(f"\nworst build p95 {worst:.2f} ms: {verdict} the {TARGET_MS:g} ms target")
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump({"first_build_ms": first, "results": results}, out, indent=2)


if __name__ == "__main__":
    main()
