"""Throughput of otel-engine offline and over HTTP, next to Hugging Face `generate`.

    .venv/bin/python bench/throughput.py [--model PATH] [--dtype bfloat16]
        [--batch-sizes 1,8,32] [--prompt-len 128] [--output-len 128]
        [--skip-offline] [--skip-hf] [--skip-http] [--json out.json]

Phases run one after another (never two at once, so they do not share the CPU):
1. offline: `LLM.generate` on B random prompts, greedy, `ignore_eos`; output tokens/s;
2. hf: transformers `generate` with static batches of the same shape, and the ratio;
3. http: `otel-engine serve` in a subprocess: startup seconds, then streaming
   `/v1/completions` at concurrency B: output tokens/s, TTFT, TPOT, and the peak RSS of every
   process of the server while it serves the largest concurrency.
Prints numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from common import (
    CpuMeter,
    MemoryPeaks,
    ServerProcess,
    fmt,
    free_port,
    own_processes,
    print_table,
    quantile,
    random_prompts,
)

SEED = 1234


def measure(phase: str, batch: int, run_once: Callable[[], int],
            repeat: int) -> dict[str, Any]:
    """Run `run_once` (which returns output tokens) `repeat` times; keep the fastest run."""
    runs: list[dict[str, Any]] = []
    for _ in range(repeat):
        meter = CpuMeter({"bench": own_processes()})
        start = time.perf_counter()
        tokens = run_once()
        wall = time.perf_counter() - start
        cores = meter.stop()
        runs.append({"batch": batch, "output_tokens": tokens, "wall_s": round(wall, 2),
                     "tok_s": round(tokens / wall, 1), "cpu_cores": cores})
        print(f"[{phase}] batch {batch:>3}: {tokens} tokens in {wall:.2f} s = "
              f"{tokens / wall:.1f} tok/s; CPU cores: {_cores(cores)}", flush=True)
    best = max(runs, key=lambda r: r["tok_s"])
    return {**best, "runs_tok_s": [r["tok_s"] for r in runs]}


def _cores(cores: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in cores.items())


def run_offline(args: argparse.Namespace, vocab_size: int) -> list[dict[str, Any]]:
    from otel_engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    began = time.monotonic()
    with LLM(model=args.model, dtype=args.dtype) as llm:
        print(f"[offline] engine ready in {time.monotonic() - began:.1f} s", flush=True)
        warmup = random_prompts(min(max(args.batch_sizes), 16), args.prompt_len, vocab_size, 0)
        llm.generate(warmup, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for batch in args.batch_sizes:
            prompts = random_prompts(batch, args.prompt_len, vocab_size, SEED + batch)

            def run_once(prompts: list[list[int]] = prompts) -> int:
                outputs = llm.generate(prompts, params)
                return sum(len(o.outputs[0].token_ids) for o in outputs)

            results.append(measure("offline", batch, run_once, args.repeat))
    return results


def run_hf(args: argparse.Namespace, model_dir: str, vocab_size: int) -> list[dict[str, Any]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad_id = model.config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id

    def generate(ids: list[list[int]], new_tokens: int) -> int:
        input_ids = torch.tensor(ids, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=pad_id)
        return int(out.shape[0] * (out.shape[1] - input_ids.shape[1]))

    generate(random_prompts(1, args.prompt_len, vocab_size, 0), 8)
    results = []
    for batch in args.batch_sizes:
        prompts = random_prompts(batch, args.prompt_len, vocab_size, SEED + batch)

        def run_once(prompts: list[list[int]] = prompts) -> int:
            return generate(prompts, args.output_len)

        results.append(measure("hf", batch, run_once, args.repeat))
    return results


async def _one_request(client: Any, model: str, prompt: list[int],
                       max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    ttft = None
    num_chunks = 0
    usage_tokens = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            num_chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    tokens = usage_tokens if usage_tokens is not None else num_chunks
    ttft = latency if ttft is None else ttft
    tpot = (latency - ttft) / (tokens - 1) if tokens > 1 else None
    return {"tokens": tokens, "ttft": ttft, "latency": latency, "tpot": tpot}


async def _http_level(base_url: str, model: str, prompts: list[list[int]], concurrency: int,
                      max_tokens: int) -> dict[str, Any]:
    from openai import AsyncOpenAI

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[dict[str, Any]] = []
    errors: list[str] = []

    async def worker() -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                records.append(await _one_request(client, model, prompt, max_tokens))
            except Exception as error:
                cause = error.__cause__
                errors.append(f"{type(error).__name__}: {error}"
                              + (f" ({type(cause).__name__}: {cause})" if cause else ""))

    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=600.0) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tokens = sum(int(r["tokens"]) for r in records)
    ttfts = [r["ttft"] for r in records]
    tpots = [r["tpot"] for r in records if r["tpot"] is not None]
    return {"concurrency": concurrency, "num_requests": len(records), "num_errors": len(errors),
            "first_error": errors[0] if errors else None, "output_tokens": tokens,
            "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 1),
            "ttft_median_ms": _ms(quantile(ttfts, 0.5)), "ttft_p90_ms": _ms(quantile(ttfts, 0.9)),
            "tpot_median_ms": _ms(quantile(tpots, 0.5))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _model_name(base_url: str) -> str:
    import httpx

    return str(httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["id"])


def run_http(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    flags = ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    server = ServerProcess(flags, free_port())
    result: dict[str, Any] = {"levels": []}
    try:
        result["startup_s"] = round(server.wait_ready(args.startup_timeout), 2)
        print(f"[http] server ready in {result['startup_s']:.1f} s", flush=True)
        model = _model_name(server.base_url)
        warmup = random_prompts(2, args.prompt_len, vocab_size, 0)
        warm = asyncio.run(_http_level(server.base_url, model, warmup, 2, 16))
        if warm["num_errors"]:
            print(f"[http] warm-up: {warm['first_error']}", file=sys.stderr, flush=True)
        for concurrency in args.batch_sizes:
            num = max(args.min_requests, args.requests_per_stream * concurrency)
            prompts = random_prompts(num, args.prompt_len, vocab_size, SEED + 1000 + concurrency)
            peaks, stop = MemoryPeaks(), threading.Event()
            sampler = threading.Thread(target=server.sample_memory, args=(stop, peaks),
                                       name="rss-sampler", daemon=True)
            sampler.start()
            meter = CpuMeter({"server": server.processes(), "client": [psutil.Process()]})
            try:
                level = asyncio.run(_http_level(server.base_url, model, prompts, concurrency,
                                                args.output_len))
            finally:
                stop.set()
                sampler.join()
            level["cpu_cores"] = meter.stop()
            if level["num_errors"]:
                print(f"[http] {level['num_errors']} requests failed, first: "
                      f"{level['first_error']}", file=sys.stderr, flush=True)
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}")
            level["peak_rss"] = peaks.as_rows()
            level["peak_rss_total_mb"] = round(peaks.total_mb, 1)
            result["levels"].append(level)
            print(f"[http] concurrency {concurrency:>3}: {level['num_requests']} requests "
                  f"({level['num_errors']} failed), "
                  f"{level['tok_s']:.1f} tok/s, TTFT median {fmt(level['ttft_median_ms'], 0)} "
                  f"ms p90 {fmt(level['ttft_p90_ms'], 0)} ms, TPOT median "
                  f"{fmt(level['tpot_median_ms'])} ms; CPU cores: {_cores(level['cpu_cores'])}",
                  flush=True)
    except Exception as error:
        cause = error.__cause__ or error.__context__
        result["error"] = f"{type(error).__name__}: {error}" + (
            f" ({type(cause).__name__}: {cause})" if cause else "")
        print(f"[http] failed: {result['error']}", file=sys.stderr, flush=True)
    finally:
        result["shutdown"] = server.stop(keep_log="error" in result)
        print(f"[http] server stopped: {result['shutdown']}", flush=True)
    return result


def print_summary(report: dict[str, Any]) -> None:
    print(f"\n== summary: {report['model']} ({report['dtype']}), prompt {report['prompt_len']} "
          f"+ output {report['output_len']} tokens, {report['cpu_count']} CPUs")
    print(f"CPU busy before start {report['cpu_busy_before_pct']:.0f}%; load averages (1/5/15 "
          f"min): " + "; ".join(f"{k} {v}" for k, v in report["load"].items()))
    offline = {r["batch"]: r for r in report.get("offline", [])}
    hf = {r["batch"]: r for r in report.get("hf", [])}
    http = {r["concurrency"]: r for r in report.get("http", {}).get("levels", [])}
    rows = []
    for b in report["batch_sizes"]:
        o, h, s = offline.get(b, {}), hf.get(b, {}), http.get(b, {})
        ratio = o["tok_s"] / h["tok_s"] if o and h else None
        rows.append([str(b), fmt(o.get("tok_s")), fmt(o.get("wall_s"), 2), fmt(h.get("tok_s")),
                     fmt(ratio, 2), fmt(s.get("tok_s")), fmt(s.get("ttft_median_ms"), 0),
                     fmt(s.get("ttft_p90_ms"), 0), fmt(s.get("tpot_median_ms"))])
    print_table(["B", "offline tok/s", "wall s", "hf tok/s", "otel/hf", "http tok/s",
                 "ttft p50 ms", "ttft p90 ms", "tpot p50 ms"], rows)
    rows = [[str(b), *(_cores_cell(table.get(b, {})) for table in (offline, hf, http))]
            for b in report["batch_sizes"]]
    print(f"CPU cores busy during each measurement, this run / other processes "
          f"({report['cpu_count']} CPUs; 'other' well above 0 means the numbers are low):")
    print_table(["B", "offline", "hf", "http server+client"], rows)
    if "http" not in report:
        return
    http_report = report["http"]
    print(f"http startup: {fmt(http_report.get('startup_s'))} s; shutdown: "
          f"{http_report.get('shutdown')}")
    if "error" in http_report:
        print(f"http error: {http_report['error']}")
    if http:
        last = http[max(http)]
        print(f"peak RSS during concurrency {last['concurrency']} "
              f"(total {last['peak_rss_total_mb']:.0f} MB):")
        for row in last["peak_rss"]:
            print(f"  {row['pid']:>8}  {row['role']:<24} {row['peak_rss_mb']:8.1f} MB")


def _cores_cell(result: dict[str, Any]) -> str:
    cores = result.get("cpu_cores")
    if not cores:
        return "-"
    return f"{sum(v for k, v in cores.items() if k != 'other'):.2f} / {cores['other']:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HF directory or .gguf file (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16",
                        choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--batch-sizes", default="1,8,32",
                        type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="HTTP requests per level = this x concurrency (at least "
                        "--min-requests)")
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each offline and HF batch this many times; keep the best")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from otel_engine.model.loader import default_model_path, load_model_arch, prepare_model_dir

    model_dir = prepare_model_dir(args.model)
    vocab_size = load_model_arch(model_dir).vocab_size
    report: dict[str, Any] = {
        "model": args.model or os.path.basename(default_model_path()), "dtype": args.dtype,
        "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "cpu_busy_before_pct": psutil.cpu_percent(interval=1.0), "load": {"start": _load()}}
    print(f"CPU busy before start: {report['cpu_busy_before_pct']:.0f}%, load average "
          f"{report['load']['start']}", flush=True)
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
