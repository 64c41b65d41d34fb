"""Speculative decoding over HTTP: output tok/s, TTFT, acceptance and exactness per prompt set.

    .venv/bin/python bench/speculative.py [--methods off,ngram,draft] [--streams 1,4,16]
        [--sets quoting,summarization,code_edit,free_chat] [--max-tokens 128]
        [--num-speculative-tokens K] [--ngram-min N] [--ngram-max N]
        [--speculative-model PATH] [--target-args '--int4 off --dtype float32']
        [--server-args ARGS] [--repeats N] [--quick] [--json out.json]

One server per configuration; a baseline's server and those of the methods compared with it
run together, each idle while another is measured, and each set at each level is measured
on each of them in turn (one group of servers started once the previous one has stopped):
- off: the engine as configured (--model, --dtype, --server-args), without speculation;
- ngram: the same with `--speculative-method ngram`;
- off-target: the draft method's target (the same plus --target-args) without speculation,
  the baseline of `draft`;
- draft: the target with `--speculative-method draft --speculative-model PATH` (by default
  the served GGUF file itself: its 4-bit path drafts for its dense self);
- vllm-off, vllm-ngram (only when listed; with --vllm-python): vLLM's OpenAI server on a dense
  bfloat16 copy of the same weights, without and with its n-gram speculation.
`off` in --methods runs the baselines of the other methods listed. Each server gets a warm-up,
then at each level of concurrent streams each prompt set (bench/spec_prompts.py) is sent as
streamed `/v1/chat/completions` at temperature 0, its prompts cycled up to the number of
streams: output tok/s, TTFT, the acceptance rate from the deltas of
`otel_engine_spec_decode_{proposed,accepted}_tokens_total`, and the speed-up over the
baseline at the same set and level. With --repeats N each set at each level is measured N
times on each server in turn, and the table gives the median of each number over the rounds,
with the speed-up's median and its range over the rounds (each round's rate over its
baseline's in the same round): at 16 streams one round's rate moves by 5-10% from the next.
Exactness: the requests whose text differs from the baseline's (a baseline is compared with
its own first level: what batching alone changes). Prints numbers only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
from common import (
    CpuMeter,
    ServerProcess,
    fmt,
    free_port,
    print_table,
    quantile,
    served_model_name,
    server_parser,
    start_benchmark,
    write_json,
)
from spec_prompts import PROMPT_SETS, WARMUP

METHODS = ("off", "ngram", "draft", "vllm-off", "vllm-ngram")
# The counters of otel-engine, and of vLLM (whose own names: the bench never asks otel-engine
# for its copies under vLLM's names, so nothing is counted twice).
PROPOSED = (
    "otel_engine_spec_decode_proposed_tokens_total",
    "vllm:spec_decode_num_draft_tokens_total",
)
ACCEPTED = (
    "otel_engine_spec_decode_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
CONTENDED_CORES = 0.25  # CPU cores taken by other processes beyond which a rate is suspect
DEFAULTS = {"streams": [1, 4, 16], "max_tokens": 128, "prompts_per_set": None}
QUICK = {"streams": [1, 4], "max_tokens": 96, "prompts_per_set": 4}
WARMUP_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Config:
    """One server's flags; `baseline` names the configuration its speed and texts are
    compared with (None: it is a baseline)."""

    name: str
    flags: tuple[str, ...]
    baseline: str | None
    engine: str = "otel-engine"  # or "vllm": vLLM's OpenAI server, in `--vllm-python`


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _levels(text: str) -> list[int]:
    return list(dict.fromkeys(int(part) for part in _csv(text)))  # in order, once each


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = server_parser(__doc__)
    parser.add_argument(
        "--methods",
        type=_csv,
        default=["off", "ngram", "draft"],
        help=f"of {','.join(METHODS)} (default: off,ngram,draft)",
    )
    parser.add_argument("--streams", type=_levels, help="1,4,16")
    parser.add_argument("--sets", type=_csv, default=list(PROMPT_SETS), help="prompt sets")
    parser.add_argument("--max-tokens", type=int, help="per request (default 128)")
    parser.add_argument("--prompts-per-set", type=int, help="the first N of each set (all)")
    parser.add_argument("--num-speculative-tokens", type=int, metavar="K")
    parser.add_argument("--ngram-min", type=int, metavar="N")
    parser.add_argument("--ngram-max", type=int, metavar="N")
    parser.add_argument(
        "--speculative-model", help="the draft method's draft (default: the served model)"
    )
    parser.add_argument(
        "--target-args",
        default="--int4 off --dtype float32",
        help="flags added to the draft method's target and its baseline (off-target)",
    )
    parser.add_argument("--server-args", default="", help="flags added to every server")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="rounds of each set at each level on each server, in turn (default 1)",
    )
    parser.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="the Python of an environment with vLLM's CPU build, for vllm-off and "
        "vllm-ngram (default: $VLLM_PYTHON)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="streams 1,4, 4 prompts per set, 96 tokens (flags given explicitly win)",
    )
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = [m for m in args.methods if m not in METHODS] + [
        s for s in args.sets if s not in PROMPT_SETS
    ]
    if unknown:
        parser.error(f"unknown methods or sets: {', '.join(unknown)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def build_configs(args: argparse.Namespace) -> list[Config]:
    """The servers to run, in order: each baseline before the method compared with it."""
    base = ["--dtype", args.dtype, "--no-enable-prefix-caching", *shlex.split(args.server_args)]
    base += ["--model", args.model] if args.model else []
    target = [*base, *shlex.split(args.target_args)]
    spec = _optional(args, "num_speculative_tokens")
    is_off = "off" in args.methods
    configs = []
    if is_off:
        configs.append(Config("off", tuple(base), None))
    if "ngram" in args.methods:
        ngram = [*spec, *_optional(args, "ngram_min"), *_optional(args, "ngram_max")]
        flags = (*base, "--speculative-method", "ngram", *ngram)
        configs.append(Config("ngram", flags, "off"))
    if "draft" in args.methods:
        draft = args.speculative_model or args.model or _default_model()
        baseline = "off-target" if target != base else "off"
        if is_off and baseline == "off-target":
            configs.append(Config("off-target", tuple(target), None))
        flags = (*target, "--speculative-method", "draft", "--speculative-model", draft, *spec)
        configs.append(Config("draft", flags, baseline))
    configs += _vllm_configs(args)
    return configs


def _vllm_configs(args: argparse.Namespace) -> list[Config]:
    """vLLM's OpenAI server on the checkpoint otel-engine converted the same file to (vLLM
    reads a Hugging Face directory; a dense copy of it, `_vllm_checkpoint`), in bfloat16,
    without and with its n-gram speculation at the same K and n-gram lengths (vLLM's defaults
    where the engine's are not given)."""
    wanted = [m for m in ("vllm-off", "vllm-ngram") if m in args.methods]
    if not wanted:
        return []
    if not args.vllm_python:
        raise SystemExit("vllm-off and vllm-ngram need --vllm-python (or $VLLM_PYTHON)")
    from otel_engine.model.loader import prepare_model_dir

    model = _vllm_checkpoint(prepare_model_dir(args.model))
    base = ["--model", model, "--served-model-name", "SmolLM2-135M-Instruct"]
    base += ["--dtype", "bfloat16", "--max-model-len", "2048", "--no-enable-prefix-caching"]
    speculative = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens or 8,
        "prompt_lookup_min": args.ngram_min or 2,
        "prompt_lookup_max": args.ngram_max or 4,
    }
    configs = []
    if "vllm-off" in wanted:
        configs.append(Config("vllm-off", tuple(base), None, "vllm"))
    if "vllm-ngram" in wanted:
        flags = (*base, "--speculative-config", json.dumps(speculative))
        configs.append(
            Config("vllm-ngram", flags, "vllm-off" if "vllm-off" in wanted else None, "vllm")
        )
    return configs


def _vllm_checkpoint(model_dir: str) -> str:
    """`model_dir` itself, or for a GGUF conversion a dense copy in a new temporary directory
    (removed at exit): its weights dequantized as otel-engine reads them (`iter_weights`),
    its config and tokenizer files copied. A conversion keeps its matrices, the embeddings
    included, in their GGUF blocks under `QUANT_FILE`, which vLLM never reads: it would load
    the norms alone and, every other weight left unset, answer token 0 (<|endoftext|>, a
    special token: empty text) up to max_tokens."""
    from safetensors.torch import save_file

    from otel_engine.model.weights import QUANT_FILE, iter_weights

    if not os.path.isfile(os.path.join(model_dir, QUANT_FILE)):
        return model_dir
    dense = tempfile.mkdtemp(prefix="otel-bench-vllm-")
    atexit.register(shutil.rmtree, dense, ignore_errors=True)
    weights = {name: tensor.contiguous() for name, tensor in iter_weights(model_dir)}
    save_file(weights, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors"):
            shutil.copy(path, dense)
    return dense


class VllmServer(ServerProcess):
    """vLLM's OpenAI server in another environment (its CPU build: `LD_PRELOAD` of that
    environment's Intel OpenMP, as its CPU guide asks, where the file is there)."""

    def __init__(self, python: str, args: list[str], port: int) -> None:
        self.python = python
        env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
        iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
        if os.path.exists(iomp):
            env["LD_PRELOAD"] = iomp
        super().__init__(args, port, env=env)

    @property
    def command(self) -> list[str]:
        serve = [self.python, "-m", "vllm.entrypoints.openai.api_server"]
        return [*serve, "--host", "127.0.0.1", "--port", str(self.port), *self.args]


def _optional(args: argparse.Namespace, name: str) -> list[str]:
    value = getattr(args, name)
    return [] if value is None else ["--" + name.replace("_", "-"), str(value)]


def _default_model() -> str:
    from otel_engine.model.loader import default_model_path

    return str(default_model_path())


def spec_counters(base_url: str) -> dict[str, float] | None:
    """Proposed and accepted draft tokens, summed over every label; None where the server
    has no such counter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=10, trust_env=False).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind = "proposed" if sample.name in PROPOSED else "accepted"
            if sample.name in PROPOSED + ACCEPTED:
                totals[kind] = totals.get(kind, 0.0) + sample.value
    if not totals:
        return None
    return {"proposed": totals.get("proposed", 0.0), "accepted": totals.get("accepted", 0.0)}


async def stream_chat(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: its text, completion tokens (from usage), finish
    reason, TTFT and latency in seconds."""
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    tokens = finish_reason = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                pieces.append(choice.delta.content)
            finish_reason = choice.finish_reason or finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    return {
        "text": "".join(pieces),
        "tokens": tokens,
        "finish_reason": finish_reason,
        "ttft": latency if ttft is None else ttft,
        "latency": latency,
    }


async def run_requests(
    base_url: str, model: str, prompts: list[str], streams: int, max_tokens: int
) -> dict[str, Any]:
    """`prompts` from `streams` client tasks, each request after the previous one; the
    records in the order of `prompts` (None for a failed request) and the wall time."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)
    records: list[dict[str, Any] | None] = [None] * len(prompts)
    errors: list[str] = []

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            try:
                records[index] = await stream_chat(client, model, prompts[index], max_tokens)
            except Exception as error:
                errors.append(f"request {index}: {type(error).__name__}: {error}")

    async with AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=600.0,
        http_client=DefaultAsyncHttpxClient(trust_env=False),  # loopback: never via a proxy
    ) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "records": records, "errors": errors}


def measure_level(
    server: ServerProcess,
    model: str,
    set_name: str,
    prompts: list[str],
    streams: int,
    max_tokens: int,
    repeat: int = 0,
) -> dict[str, Any]:
    """One prompt set at one level of streams (its round `repeat`), with the speculation
    counters' deltas."""
    requests = [prompts[i % len(prompts)] for i in range(max(len(prompts), streams))]
    before = spec_counters(server.base_url)
    meter = CpuMeter({"server": server.processes(), "client": [psutil.Process()]})
    run = asyncio.run(run_requests(server.base_url, model, requests, streams, max_tokens))
    cores = meter.stop()
    after = spec_counters(server.base_url)
    done = [r for r in run["records"] if r is not None]
    tokens = sum(int(r["tokens"] or 0) for r in done)
    level: dict[str, Any] = {
        "set": set_name,
        "streams": streams,
        "repeat": repeat,
        "num_prompts": len(prompts),
        "num_requests": len(requests),
        "num_errors": len(run["errors"]),
        "errors": run["errors"][:3],
        "output_tokens": tokens,
        "wall_s": round(run["wall_s"], 2),
        "tok_s": round(tokens / run["wall_s"], 1),
        "ttft_median_ms": _ms(quantile([r["ttft"] for r in done], 0.5)),
        "tpot_median_ms": _ms(quantile([_tpot(r) for r in done if r["tokens"] > 1], 0.5)),
        "num_length_finishes": sum(r["finish_reason"] == "length" for r in done),
        "cpu_cores": cores,
        "records": [
            None
            if r is None
            else {**r, "ttft": round(r["ttft"], 4), "latency": round(r["latency"], 4)}
            for r in run["records"]
        ],
    }
    if before is not None and after is not None:
        proposed = after["proposed"] - before["proposed"]
        accepted = after["accepted"] - before["accepted"]
        level |= {"proposed": proposed, "accepted": accepted}
        level["acceptance"] = round(accepted / proposed, 4) if proposed else None
    return level


def _tpot(record: dict[str, Any]) -> float:
    return float((record["latency"] - record["ttft"]) / (record["tokens"] - 1))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


class Served:
    """One configuration's server and what it measured (`result`: the report's run)."""

    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.config = config
        self.server = (
            VllmServer(args.vllm_python, list(config.flags), free_port())
            if config.engine == "vllm"
            else ServerProcess(list(config.flags), free_port())
        )
        self.result: dict[str, Any] = {
            "name": config.name,
            "flags": list(config.flags),
            "levels": [],
        }
        self.model = ""

    def start(self, timeout: float) -> None:
        """Wait for the server (started with this object) and warm it up."""
        name = self.config.name
        print(f"[{name}] serve {shlex.join(self.config.flags)}", flush=True)
        self._guard(self._start, timeout)
        if "error" not in self.result:
            ready = f"ready in {self.result['startup_s']:.1f} s, {self.result['warm']}"
            print(f"[{name}] {ready}", flush=True)

    def _start(self, timeout: float) -> None:
        self.result["startup_s"] = round(self.server.wait_ready(timeout), 2)
        self.model = served_model_name(self.server.base_url)
        url = self.server.base_url
        warm = asyncio.run(run_requests(url, self.model, list(WARMUP), len(WARMUP), WARMUP_TOKENS))
        self.result["warm"] = f"warm-up {warm['wall_s']:.1f} s ({len(warm['errors'])} failed)"

    def measure(
        self, args: argparse.Namespace, set_name: str, streams: int, repeat: int = 0
    ) -> None:
        """One prompt set at one level of streams, its round `repeat` (nothing once the
        server has failed)."""
        if "error" in self.result:
            return
        self._guard(self._measure, args, set_name, streams, repeat)

    def _measure(self, args: argparse.Namespace, set_name: str, streams: int, repeat: int) -> None:
        prompts = list(PROMPT_SETS[set_name][: args.prompts_per_set])
        level = measure_level(
            self.server, self.model, set_name, prompts, streams, args.max_tokens, repeat
        )
        self.result["levels"].append(level)
        print(f"[{self.config.name}] {_level_line(level)}", flush=True)
        if self.server.returncode is not None:
            raise RuntimeError(f"server exited with {self.server.returncode}")

    def _guard(self, step: Callable[..., None], *step_args: Any) -> None:
        try:
            step(*step_args)
        except Exception as error:
            self.result["error"] = f"{type(error).__name__}: {error}"
            print(
                f"[{self.config.name}] failed: {self.result['error']}", file=sys.stderr, flush=True
            )

    def stop(self) -> dict[str, Any]:
        self.result["shutdown"] = self.server.stop(keep_log="error" in self.result)
        self.result.pop("warm", None)
        return self.result


def groups(configs: list[Config]) -> list[list[Config]]:
    """The configurations each compared with one baseline, that baseline first; a method
    whose baseline is not run, alone."""
    by_baseline: dict[str, list[Config]] = {c.name: [c] for c in configs if c.baseline is None}
    alone: list[Config] = []
    for config in configs:
        if config.baseline is not None:
            by_baseline.get(config.baseline, alone).append(config)
    return [*by_baseline.values(), *([c] for c in alone)]


def run_group(args: argparse.Namespace, group: list[Config]) -> dict[str, dict[str, Any]]:
    """A baseline and the methods compared with it, their servers up together (each idle
    while another is measured): each set at each level (each of its rounds) is measured on
    each in turn, the order reversed from one round to the next, so that the pairs compared
    were measured a minute apart at most, not a server's whole run apart (the rate of this
    machine drifts by 10% and more over minutes)."""
    served: list[Served] = []
    try:
        for config in group:  # each server starts here, the group's together
            served.append(Served(args, config))
        for one in served:
            one.start(args.startup_timeout)
        turn = 0
        for streams in args.streams:
            for set_name in args.sets:
                for repeat in range(args.repeats):
                    for one in served if turn % 2 == 0 else reversed(served):
                        one.measure(args, set_name, streams, repeat)
                    turn += 1
    finally:
        results = {one.config.name: one.stop() for one in served}
    return results


def _level_line(level: dict[str, Any]) -> str:
    acceptance = level.get("acceptance")
    return (
        f"{level['set']:<13} streams {level['streams']:>2}: {level['num_requests']} requests "
        f"({level['num_errors']} failed), {level['output_tokens']} tokens, "
        f"{level['tok_s']:.1f} tok/s, TTFT median {fmt(level['ttft_median_ms'], 0)} ms, "
        f"acceptance {fmt(None if acceptance is None else 100 * acceptance)}%; CPU cores: "
        + ", ".join(f"{k} {v:.2f}" for k, v in level["cpu_cores"].items())
    )


def exactness(level: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """The requests of `level` whose text differs from the same prompt's in `reference` (a
    failed request counts as differing), each with the characters shared before the first
    difference."""
    differing = []
    for index, mine in enumerate(level["records"]):
        theirs = reference["records"][index % reference["num_prompts"]]
        if mine is None or theirs is None:
            differing.append({"request": index, "shared_chars": 0})
        elif mine["text"] != theirs["text"]:
            differing.append(
                {"request": index, "shared_chars": _shared(mine["text"], theirs["text"])}
            )
    return {
        "num_compared": len(level["records"]),
        "num_differing": len(differing),
        "differing": differing,
    }


def _shared(a: str, b: str) -> int:
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def analyse(configs: list[Config], runs: dict[str, dict[str, Any]], first_streams: int) -> None:
    """Add to every level its speed-up over its baseline's in the same round and its
    exactness: a method's texts against its baseline's at the same set, level and round, a
    baseline's against its own first round at the first level (what batching alone
    changes); then to every run its `summary` over the rounds (`summarize`)."""
    by_key = {
        name: {(lv["set"], lv["streams"], lv.get("repeat", 0)): lv for lv in run["levels"]}
        for name, run in runs.items()
    }
    for config in configs:
        for key, level in by_key[config.name].items():
            if config.baseline is None:
                reference = by_key[config.name].get((key[0], first_streams, 0))
                if reference is not None and reference is not level:
                    level["exactness"] = exactness(level, reference) | {"against": "first level"}
                continue
            base = by_key.get(config.baseline, {}).get(key)
            if base is None:
                continue
            level["speed_up"] = round(level["tok_s"] / base["tok_s"], 3) if base["tok_s"] else None
            level["is_baseline_contended"] = _is_contended(base)
            level["exactness"] = exactness(level, base) | {"against": config.baseline}
    for run in runs.values():
        run["summary"] = summarize(run["levels"])


def summarize(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per set and level over its rounds: the median of the rounds' tok/s, TTFT and
    TPOT medians, the median speed-up and its range, the acceptance of all their proposals,
    and their differing requests together."""
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for level in levels:
        rounds.setdefault((level["set"], level["streams"]), []).append(level)
    rows = []
    for (set_name, streams), measured in rounds.items():
        row: dict[str, Any] = {
            "set": set_name,
            "streams": streams,
            "rounds": len(measured),
            "num_requests": sum(lv["num_requests"] for lv in measured),
            "num_errors": sum(lv["num_errors"] for lv in measured),
            "output_tokens": sum(lv["output_tokens"] for lv in measured),
            "is_contended": any(_is_contended(lv) for lv in measured),
            "is_baseline_contended": any(lv.get("is_baseline_contended") for lv in measured),
        }
        for name in ("tok_s", "ttft_median_ms", "tpot_median_ms"):
            row[name] = _median([lv[name] for lv in measured])
        speed_ups = [lv["speed_up"] for lv in measured if lv.get("speed_up") is not None]
        row["speed_up"] = _median(speed_ups)
        row["speed_up_range"] = [min(speed_ups), max(speed_ups)] if speed_ups else None
        if all("proposed" in lv for lv in measured):
            proposed = sum(lv["proposed"] for lv in measured)
            accepted = sum(lv["accepted"] for lv in measured)
            row |= {"proposed": proposed, "accepted": accepted}
            row["acceptance"] = round(accepted / proposed, 4) if proposed else None
        checks = [lv["exactness"] for lv in measured if "exactness" in lv]
        if checks:
            row["exactness"] = {
                "against": checks[0]["against"],
                "num_compared": sum(c["num_compared"] for c in checks),
                "num_differing": sum(c["num_differing"] for c in checks),
            }
        rows.append(row)
    return rows


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    middle = quantile(present, 0.5)
    return None if middle is None else round(middle, 3)


def print_summary(report: dict[str, Any]) -> None:
    runs: dict[str, dict[str, Any]] = report["runs"]
    print(
        f"\n== speculative decoding: {report['model']}, {report['max_tokens']} tokens at most, "
        f"temperature 0, {report['cpu_count']} CPUs; CPU busy before start "
        f"{report['cpu_busy_before_pct']:.0f}%"
    )
    repeats = report.get("repeats", 1)
    rows = []
    for set_name in report["sets"]:
        for streams in report["streams"]:
            for name, run in runs.items():
                summary = next(
                    (
                        row
                        for row in run.get("summary", [])
                        if (row["set"], row["streams"]) == (set_name, streams)
                    ),
                    None,
                )
                if summary is not None:
                    rows.append(_row(name, summary))
    headers = ["set", "streams", "config", "requests", "tokens", "tok/s", "speed-up"]
    headers += ["ttft p50 ms", "tpot p50 ms", "accepted", "differ"]
    if rows:
        print_table(headers, rows)
    rounds = (
        f"each number the median of {repeats} rounds, the speed-up's range over them in "
        f"parentheses. "
        if repeats > 1
        else ""
    )
    print(
        f"speed-up: tok/s over the baseline's (off; off-target for draft) at the same set and "
        f"streams; {rounds}differ: requests whose text is not the baseline's; in parentheses, "
        f"a baseline against itself at {report['streams'][0]} stream(s). * other processes took "
        f"more than {CONTENDED_CORES} CPU cores during that level (for a speed-up: or during "
        f"the baseline's): rerun"
    )
    print("\n== exactness (temperature 0): requests whose text differs from the baseline's")
    rows = []
    for name, run in runs.items():
        checks = [row for row in run.get("summary", []) if "exactness" in row]
        if checks:
            against = checks[0]["exactness"]["against"]
            cells = [
                _differing([c for c in checks if c["streams"] == n]) for n in report["streams"]
            ]
            rows.append([name, against, *cells, _differing(checks)])
    if rows:
        print_table(
            ["config", "against", *(f"{n} streams" for n in report["streams"]), "all"], rows
        )
    for name, run in runs.items():
        print(
            f"{name}: startup {fmt(run.get('startup_s'))} s; shutdown {run.get('shutdown')}"
            + (f"; error: {run['error']}" if "error" in run else "")
        )


def _differing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "-"
    differing = sum(row["exactness"]["num_differing"] for row in rows)
    return f"{differing}/{sum(row['exactness']['num_compared'] for row in rows)}"


def _is_contended(level: dict[str, Any]) -> bool:
    return bool(level["cpu_cores"].get("other", 0.0) > CONTENDED_CORES)


def _row(name: str, summary: dict[str, Any]) -> list[str]:
    """A table row of one configuration's `summarize` row."""
    contended = summary["is_contended"]
    is_suspect = contended or summary["is_baseline_contended"]
    speed_up_mark = "*" if is_suspect and summary.get("speed_up") is not None else ""
    acceptance = summary.get("acceptance")
    check = summary.get("exactness")
    differ = "-"
    if check is not None:
        differ = f"{check['num_differing']}/{check['num_compared']}"
        differ = f"({differ})" if check["against"] == "first level" else differ
    speed_up = fmt(summary.get("speed_up"), 2) + speed_up_mark
    spread = summary.get("speed_up_range")
    if spread is not None and summary["rounds"] > 1:
        speed_up += f" ({spread[0]:.2f}-{spread[1]:.2f})"
    return [
        summary["set"],
        str(summary["streams"]),
        name,
        f"{summary['num_requests'] - summary['num_errors']}/{summary['num_requests']}",
        str(summary["output_tokens"]),
        fmt(summary["tok_s"]) + ("*" if contended else ""),
        speed_up,
        fmt(summary["ttft_median_ms"], 0),
        fmt(summary["tpot_median_ms"]),
        "-" if acceptance is None else f"{100 * acceptance:.1f}%",
        differ,
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_benchmark(args.model)
    configs = build_configs(args)
    report: dict[str, Any] = {
        "model": args.model or os.path.basename(_default_model()),
        "dtype": args.dtype,
        "methods": args.methods,
        "sets": args.sets,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "prompts_per_set": args.prompts_per_set,
        "repeats": args.repeats,
        "configs": [
            {"name": c.name, "flags": list(c.flags), "baseline": c.baseline} for c in configs
        ],
        "cpu_count": os.cpu_count(),
        "cpu_busy_before_pct": psutil.cpu_percent(interval=1.0),
        "load_before": os.getloadavg(),
        "runs": {},
    }
    began = time.monotonic()
    for group in groups(configs):
        report["runs"] |= run_group(args, group)
    report["wall_s"] = round(time.monotonic() - began, 1)
    analyse(configs, report["runs"], args.streams[0])
    print_summary(report)
    print(f"whole run: {report['wall_s']:.0f} s")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
