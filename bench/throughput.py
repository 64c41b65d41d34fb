"""Throughput of otel-engine offline and over HTTP, next to Hugging Face `generate`.

    .venv/bin/python bench/throughput.py [--model PATH] [--dtype bfloat16]
        [--scenario standard|long] [--batch-sizes 1,8,32] [--prompt-len 128] [--output-len 128]
        [--repeat N] [--skip-offline] [--skip-hf] [--skip-http] [--json out.json]

Phases run one after another (never two at once, so they do not share the CPU):
1. offline: `LLM.generate` on B random prompts, greedy, `ignore_eos`; output tokens/s;
2. hf: transformers `generate` with static batches of the same shape, and the ratio;
3. http: `otel-engine serve` in a subprocess: startup seconds, then streaming
   `/v1/completions` at concurrency B: output tokens/s, TTFT, TPOT, and the peak RSS of every
   process of the server while it serves the largest concurrency.
Every measurement also says how many CPU cores it used and how many other processes took
(contention). Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
from common import (
    CpuMeter,
    MemoryPeaks,
    ServerProcess,
    add_request_count_args,
    fmt,
    free_port,
    own_processes,
    print_table,
    random_prompts,
    requests_at,
    run_concurrency,
    served_model_name,
)

from otel_engine.config import QuantActivations

SEED = 1234
REPEAT_SEED_STRIDE = 100_003
SCENARIOS: dict[str, dict[str, Any]] = {
    "standard": {"batch_sizes": [1, 8, 32], "prompt_len": 128, "output_len": 128},
    "long": {"batch_sizes": [8], "prompt_len": 1024, "output_len": 128},
}
CONTENDED_CORES = 0.25  # CPU cores taken by other processes beyond which a number is suspect


def measure(phase: str, batch: int, run_once: Callable[[], int], repeat: int) -> dict[str, Any]:
    """Run `run_once` (which returns output tokens) `repeat` times; keep the fastest run."""
    runs: list[dict[str, Any]] = []
    for _ in range(repeat):
        meter = CpuMeter({"bench": own_processes()})
        start = time.perf_counter()
        tokens = run_once()
        wall = time.perf_counter() - start
        cores = meter.stop()
        runs.append(
            {
                "batch": batch,
                "output_tokens": tokens,
                "wall_s": round(wall, 2),
                "tok_s": round(tokens / wall, 1),
                "cpu_cores": cores,
            }
        )
        print(
            f"[{phase}] batch {batch:>3}: {tokens} tokens in {wall:.2f} s = "
            f"{tokens / wall:.1f} tok/s; CPU cores: {_cores(cores)}",
            flush=True,
        )
    best = max(runs, key=lambda r: r["tok_s"])
    return {**best, "runs_tok_s": [r["tok_s"] for r in runs]}


def _cores(cores: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in cores.items())


def run_offline(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    from otel_engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    began = time.monotonic()
    with LLM(model=args.model, dtype=args.dtype, quant_activations=args.quant_activations) as llm:
        print(f"[offline] engine ready in {time.monotonic() - began:.1f} s", flush=True)
        warmup = random_prompts(min(max(args.batch_sizes), 16), args.prompt_len, vocab_size, 0)
        llm.generate(warmup, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for batch in args.batch_sizes:
            attempts = itertools.count()

            def run_once(batch: int = batch, attempts: Iterator[int] = attempts) -> int:
                # New prompts for each repeat: the prefix cache would serve the same ones.
                seed = SEED + batch + REPEAT_SEED_STRIDE * next(attempts)
                outputs = llm.generate(
                    random_prompts(batch, args.prompt_len, vocab_size, seed), params
                )
                return sum(len(o.outputs[0].token_ids) for o in outputs)

            results.append(measure("offline", batch, run_once, args.repeat))
    return results


def run_hf(args: argparse.Namespace, model_dir: str, vocab_size: int) -> list[dict[str, Any]]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from otel_engine.model.weights import iter_weights

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(model_dir)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else config.dtype
    # a GGUF conversion keeps its layer matrices in their blocks: dequantized here
    weights = dict(iter_weights(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    model.eval()
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id

    def generate(ids: list[list[int]], new_tokens: int) -> int:
        input_ids = torch.tensor(ids, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return int(out.shape[0] * (out.shape[1] - input_ids.shape[1]))

    generate(random_prompts(1, args.prompt_len, vocab_size, 0), 8)
    results = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, vocab_size, SEED + batch)

        def run_once(prompts: list[list[int]] = prompts) -> int:
            return generate(prompts, args.output_len)

        results.append(measure("hf", batch, run_once, args.repeat))
    return results


def _measure_level(
    server: ServerProcess, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """One concurrency level, with the server's peak RSS and the CPU cores used."""
    peaks, stop = MemoryPeaks(), threading.Event()
    sampler = threading.Thread(
        target=server.sample_memory, args=(stop, peaks), name="rss-sampler", daemon=True
    )
    sampler.start()
    meter = CpuMeter({"server": server.processes(), "client": [psutil.Process()]})
    try:
        level = asyncio.run(
            run_concurrency(server.base_url, model, prompts, concurrency, max_tokens)
        )
    finally:
        stop.set()
        sampler.join()
    level["cpu_cores"] = meter.stop()
    if level["num_errors"]:
        print(
            f"[http] {level['num_errors']} requests failed, first: {level['first_error']}",
            file=sys.stderr,
            flush=True,
        )
    if server.proc.poll() is not None:
        raise RuntimeError(f"server exited with {server.proc.returncode}")
    level["peak_rss"] = peaks.as_rows()
    level["peak_rss_total_mb"] = round(peaks.total_mb, 1)
    print(
        f"[http] concurrency {concurrency:>3}: {level['num_requests']} requests "
        f"({level['num_errors']} failed), {level['tok_s']:.1f} tok/s, TTFT median "
        f"{fmt(level['ttft_median_ms'], 0)} ms p90 {fmt(level['ttft_p90_ms'], 0)} ms, TPOT "
        f"median {fmt(level['tpot_median_ms'])} ms; CPU cores: {_cores(level['cpu_cores'])}",
        flush=True,
    )
    return level


def run_http(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    flags = ["--dtype", args.dtype, "--quant-activations", args.quant_activations]
    flags += ["--model", args.model] if args.model else []
    server = ServerProcess(flags, free_port())
    result: dict[str, Any] = {"levels": []}
    try:
        result["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        print(f"[http] server ready in {result['startup_s']:.1f} s", flush=True)
        model = served_model_name(server.base_url)
        num_warmup = min(max(args.batch_sizes), 16)
        warmup = random_prompts(num_warmup, args.prompt_len, vocab_size, 0)
        warm = asyncio.run(run_concurrency(server.base_url, model, warmup, num_warmup, 8))
        result["warmup"] = warm
        print(
            f"[http] warm-up: {num_warmup} requests in {warm['wall_s']:.1f} s "
            f"({warm['num_errors']} failed)",
            flush=True,
        )
        for concurrency in args.batch_sizes:
            num = requests_at(args, concurrency)
            runs = []
            for attempt in range(args.repeat):  # new prompts each time (prefix cache)
                seed = SEED + 1000 + concurrency + REPEAT_SEED_STRIDE * attempt
                prompts = random_prompts(num, args.prompt_len, vocab_size, seed)
                runs.append(_measure_level(server, model, prompts, concurrency, args.output_len))
            level = max(runs, key=lambda r: r["tok_s"])
            level["runs_tok_s"] = [r["tok_s"] for r in runs]
            result["levels"].append(level)
    except Exception as error:
        cause = error.__cause__ or error.__context__
        result["error"] = f"{type(error).__name__}: {error}" + (
            f" ({type(cause).__name__}: {cause})" if cause else ""
        )
        print(f"[http] failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        result["shutdown"] = server.stop(keep_log="error" in result)
        print(f"[http] server stopped: {result['shutdown']}", flush=True)
    return result


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n== summary: {report['model']} ({report['dtype']}), prompt {report['prompt_len']} "
        f"+ output {report['output_len']} tokens, {report['cpu_count']} CPUs"
    )
    print(
        f"CPU busy before start {report['cpu_busy_before_pct']:.0f}%; load averages (1/5/15 "
        f"min): " + "; ".join(f"{k} {v}" for k, v in report["load"].items())
    )
    offline = {r["batch"]: r for r in report.get("offline", [])}
    hf = {r["batch"]: r for r in report.get("hf", [])}
    http = {r["concurrency"]: r for r in report.get("http", {}).get("levels", [])}
    rows = []
    for b in report["batch_sizes"]:
        o, h, s = offline.get(b, {}), hf.get(b, {}), http.get(b, {})
        ratio = o["tok_s"] / h["tok_s"] if o and h else None
        rows.append(
            [
                str(b),
                _rate(o),
                fmt(o.get("wall_s"), 2),
                _rate(h),
                fmt(ratio, 2),
                _rate(s),
                fmt(s.get("ttft_median_ms"), 0),
                fmt(s.get("ttft_p90_ms"), 0),
                fmt(s.get("tpot_median_ms")),
            ]
        )
    print_table(
        [
            "B",
            "offline tok/s",
            "wall s",
            "hf tok/s",
            "otel/hf",
            "http tok/s",
            "ttft p50 ms",
            "ttft p90 ms",
            "tpot p50 ms",
        ],
        rows,
    )
    rows = [
        [str(b), *(_cores_cell(table.get(b, {})) for table in (offline, hf, http))]
        for b in report["batch_sizes"]
    ]
    if any(cell.endswith("*") for row in rows for cell in row):
        print(f"* other processes took more than {CONTENDED_CORES} CPU cores: too low, rerun")
    print(
        f"CPU cores busy during each measurement, this run / other processes "
        f"({report['cpu_count']} CPUs):"
    )
    print_table(["B", "offline", "hf", "http server+client"], rows)
    if "http" not in report:
        return
    http_report = report["http"]
    print(
        f"http startup: {fmt(http_report.get('startup_s'))} s; shutdown: "
        f"{http_report.get('shutdown')}"
    )
    if "error" in http_report:
        print(f"http error: {http_report['error']}")
    if http:
        last = http[max(http)]
        print(
            f"peak RSS during concurrency {last['concurrency']} "
            f"(total {last['peak_rss_total_mb']:.0f} MB):"
        )
        for row in last["peak_rss"]:
            print(f"  {row['pid']:>8}  {row['role']:<24} {row['peak_rss_mb']:8.1f} MB")


def _rate(result: dict[str, Any]) -> str:
    other = result.get("cpu_cores", {}).get("other", 0.0)
    return fmt(result.get("tok_s")) + ("*" if other > CONTENDED_CORES else "")


def _cores_cell(result: dict[str, Any]) -> str:
    cores = result.get("cpu_cores")
    if not cores:
        return "-"
    return f"{sum(v for k, v in cores.items() if k != 'other'):.2f} / {cores['other']:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf file (default: the default model)")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16")
    )
    parser.add_argument(
        "--quant-activations",
        default="int8",
        choices=[a.value for a in QuantActivations],
        help="the engine's --quant-activations (a GGUF model's small steps: x in 8 bits, or "
        "the exact weights in the model dtype)",
    )
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default="standard",
        help="standard: 128 + 128 tokens at batch 1, 8, 32; long: 1,024-token prompts + 128 "
        "at batch 8 (the flags below override either)",
    )
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--output-len", type=int)
    add_request_count_args(parser)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each batch size / concurrency this many times; keep the fastest run",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for name, value in SCENARIOS[args.scenario].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops the server
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from otel_engine.model.arch import load_model_arch
    from otel_engine.model.loader import default_model_path, prepare_model_dir

    model_dir = prepare_model_dir(args.model)
    vocab_size = load_model_arch(model_dir).vocab_size
    report: dict[str, Any] = {
        "model": args.model or os.path.basename(default_model_path()),
        "dtype": args.dtype,
        "batch_sizes": args.batch_sizes,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cpu_busy_before_pct": psutil.cpu_percent(interval=1.0),
        "load": {"start": _load()},
    }
    print(
        f"CPU busy before start: {report['cpu_busy_before_pct']:.0f}%, load average "
        f"{report['load']['start']}",
        flush=True,
    )
    if not args.skip_offline:
        report["offline"] = run_offline(args, vocab_size)
        report["load"]["after_offline"] = _load()
    if not args.skip_hf:
        report["hf"] = run_hf(args, model_dir, vocab_size)
        report["load"]["after_hf"] = _load()
    if not args.skip_http:
        report["http"] = run_http(args, vocab_size)
        report["load"]["after_http"] = _load()
    print_summary(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=2)
    return 0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
