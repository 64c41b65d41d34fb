"""otel-engine against llama.cpp's llama-server on the same GGUF files of real model shapes.

    .venv/bin/python bench/models.py [--shapes llama-3.2-1b,qwen2.5-3b-like,llama-3.1-8b]
        [--formats Q4_K_M,Q8_0,Q4_0] [--engines otel-engine,llama.cpp] [--streams 1,16]
        [--prompt-tokens 128] [--max-tokens 128] [--prefill-tokens 1024] [--prepare-only]
        [--isa baseline|avx2|avx512|avx512bf16] [--dtype auto]

Both engines run at one instruction-set level: this CPU's own, or with `--isa` a level at or
below it (bench/isa_caps.py: otel-engine under the caps of torch, oneDNN and its kernels;
llama.cpp built for that level), so that any machine measures any level it contains.

Prepares everything it needs under `.cache/` (git-ignored), each step skipped when its output
exists:
1. llama.cpp built from the sources in the `llama-cpp-python` sdist on PyPI (cmake, Release,
   CPU only, without AMX, `-march=native` or with `--isa` for that level alone: see
   `llama_cpp_options`): `llama-quantize`, `llama-server`, `llama-bench` in
   `.cache/llama.cpp/build/bin` (`build-<level>/bin` for a level); the features the build
   reports (its `system_info` line) are printed and kept;
2. per shape, a Hugging Face Llama checkpoint of that shape with random weights (normal, std
   0.02; norms 1) and SmolLM2's tokenizer (the default model's, vocabulary 49,152), written
   tensor by tensor in bfloat16 safetensors shards of at most 2 GiB (memory stays near one);
   then llama.cpp's `convert_hf_to_gguf.py` to a BF16 GGUF, and `llama-quantize` to each
   format, in `.cache/models/<shape>/`. The 8B shape's checkpoint and BF16 GGUF (16 GB each)
   are deleted once what was asked for is quantized.
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

Decode speed is also held against the memory read limit. Before any server starts, this
machine's peak read bandwidth is measured once with `--threads` torch threads (the servers'
count; otel_engine/model/bandwidth.py, cached per CPU and thread count) and printed. The bytes
a decode step reads are counted from the GGUF file, the same for both engines (`DecodeReads`):
every tensor of the file as stored, once a step (layer matrices and norms, the output norm,
the LM head: `output.weight`, or `token_embd` where there is none), but of a `token_embd`
beside an `output.weight` only one row per stream; plus, per stream, K and V of
2 x layers x KV heads x head dim values a token at the mean context of the timed steps
(prompt + max_tokens / 2), in f16 for llama.cpp (llama-server's default KV type) and in
otel-engine's selected dtype (`kernels.selected`). Each stream count's table row has
"decode GB/s" (those bytes / TPOT median) and "of peak" (that / the peak); for otel-engine
its own count from `/metrics` (`otel_engine_decode_bandwidth_bytes_per_second` and `_ratio`,
its last second of decode-only steps, otel_engine/model/step_reads.py) is scraped right after
each stream count and printed in its log line. `--json` keeps all of it.
Random weights make the text meaningless; the work per token is that of the real model. Prints
numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass
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
    metric_value,
    random_prompts,
    requests_at,
    run_concurrency,
    served_model_name,
    write_json,
)
from isa_caps import Level, reported_features, runnable

from otel_engine.config import DTYPES
from otel_engine.model.kernels import ISA_LEVELS, cpu_isa

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
LLAMA_CPP_DIR = CACHE / "llama.cpp"
MODELS_DIR = CACHE / "models"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # vendors llama.cpp 0c1e570 (December 2026)
LLAMA_CPP_TARGETS = ("llama-quantize", "llama-server", "llama-bench")
BUILD_JOBS = 2
SEED = 1234
PREFILL_SEED_OFFSET = 10_000
CONTENDED_CORES = 0.25  # CPU cores taken by other processes beyond which a number is suspect
KV_BLOCK_TOKENS = 16  # otel-engine's --block-size here


def _run(command: list[object], **options: Any) -> float:
    """Run `command` (output through), raise on failure; seconds it took."""
    print("+ " + " ".join(str(c) for c in command), flush=True)
    began = time.monotonic()
    subprocess.run([str(c) for c in command], check=True, **options)
    return time.monotonic() - began


def llama_cpp_source() -> Path:
    """The llama.cpp tree vendored in the `llama-cpp-python` sdist, downloaded with pip and
    unpacked under `.cache/llama.cpp/src` once."""
    src = LLAMA_CPP_DIR / "src"
    tree = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    sdist = src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        _run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", src])
    with tarfile.open(sdist) as archive:
        archive.extractall(src, filter="tar")
    return tree


def llama_cpp_options(level: Level | None = None) -> dict[str, str]:
    """The cmake cache entries of the build: Release, CPU only, static, no network features;
    for this CPU (`level` None) or for `level`'s instructions alone (`Level.ggml_options`).
    On x86-64 never AMX: ggml's AMX matmul crashes in its first call on this project's
    Sapphire Rapids VM (SIGSEGV at `ldtilecfg`; llama.cpp issue #20824, a fix proposed in PR
    #26954), so llama.cpp runs its AVX-512 VNNI kernels there."""
    options = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",
        "GGML_NATIVE": "ON",
        "GGML_CUDA": "OFF",
        "GGML_METAL": "OFF",
        "GGML_VULKAN": "OFF",
        "LLAMA_CURL": "OFF",  # older trees; this one has LLAMA_OPENSSL
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        "LLAMA_BUILD_APP": "OFF",
        "LLAMA_BUILD_UI": "OFF",
        "LLAMA_USE_PREBUILT_UI": "OFF",  # the web UI from a Hugging Face bucket: not wanted
    }
    if level is not None:
        return options | level.ggml_options()
    if platform.machine() in ("x86_64", "AMD64"):
        # Explicit -mno-* flags win over what -march=native implies, whatever their order.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        options |= {"CMAKE_C_FLAGS": no_amx, "CMAKE_CXX_FLAGS": no_amx}
    return options


def llama_cpp_build_dir(level: Level | None = None) -> Path:
    """Where llama.cpp is built: `build` for this CPU, `build-<level>` for a level."""
    return LLAMA_CPP_DIR / ("build" if level is None else f"build-{level.name}")


def build_llama_cpp(level: Level | None = None) -> Path:
    """Build llama.cpp's tools once (`llama_cpp_options`); the directory of the binaries.
    Skipped when they exist and were built with the same options (a stamp file says)."""
    build = llama_cpp_build_dir(level)
    bin_dir, stamp = build / "bin", build / "otel-bench-options.json"
    options = llama_cpp_options(level)
    wanted = json.dumps({"version": LLAMA_CPP_PYTHON_VERSION, **options}, sort_keys=True)
    built = all((bin_dir / target).exists() for target in LLAMA_CPP_TARGETS)
    if built and stamp.exists() and stamp.read_text() == wanted:
        return bin_dir
    source = llama_cpp_source()
    began = time.monotonic()
    stamp.unlink(missing_ok=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", source, "-B", build, *generator]
    _run(configure + [f"-D{key}={value}" for key, value in options.items()])
    targets = [arg for target in LLAMA_CPP_TARGETS for arg in ("--target", target)]
    _run(["cmake", "--build", build, "-j", str(BUILD_JOBS), *targets])
    stamp.write_text(wanted)
    print(f"[build] llama.cpp built in {time.monotonic() - began:.0f} s: {bin_dir}", flush=True)
    return bin_dir


def llama_cpp_system_info(bin_dir: Path) -> str:
    """The `system_info:` line llama-server logs at start (at trace verbosity, before it
    loads a model): the CPU features the build has compiled in. Read by starting it on a
    file that does not exist, so it exits at once."""
    command = [bin_dir / "llama-server", "-lv", "4", "-m", bin_dir / "no-such-model.gguf"]
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=60, check=False
    )
    for line in (done.stdout + done.stderr).splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:") :].strip()
    return ""


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, written as a Hugging Face `LlamaForCausalLM` checkpoint."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_theta: float
    context: int
    large: bool = False  # delete the checkpoint and the BF16 GGUF once quantized


VOCAB_SIZE = 49152  # SmolLM2's tokenizer
SHAPES = {
    shape.name: shape
    for shape in (
        Shape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, True, 500000.0, 131072),
        Shape("qwen2.5-3b-like", 2048, 36, 16, 2, 128, 11008, True, 1000000.0, 32768),
        Shape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, False, 500000.0, 131072, large=True),
    )
}
FORMATS = ("Q4_K_M", "Q8_0", "Q4_0")
ENGINES = ("otel-engine", "llama.cpp")
WEIGHT_STD = 0.02
SHARD_BYTES = 2 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tensor_plan(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in file order: name and shape."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (VOCAB_SIZE, shape.hidden))
    ]
    for i in range(shape.layers):
        prefix = f"model.layers.{i}."
        plan += [
            (prefix + "input_layernorm.weight", (shape.hidden,)),
            (prefix + "self_attn.q_proj.weight", (q_dim, shape.hidden)),
            (prefix + "self_attn.k_proj.weight", (kv_dim, shape.hidden)),
            (prefix + "self_attn.v_proj.weight", (kv_dim, shape.hidden)),
            (prefix + "self_attn.o_proj.weight", (shape.hidden, q_dim)),
            (prefix + "post_attention_layernorm.weight", (shape.hidden,)),
            (prefix + "mlp.gate_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.up_proj.weight", (shape.ffn, shape.hidden)),
            (prefix + "mlp.down_proj.weight", (shape.hidden, shape.ffn)),
        ]
    plan.append(("model.norm.weight", (shape.hidden,)))
    if not shape.tied:
        plan.append(("lm_head.weight", (VOCAB_SIZE, shape.hidden)))
    return plan


def _shards(plan: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The plan cut into runs of at most `SHARD_BYTES` (bfloat16) each."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in plan:
        nbytes = 2 * _numel(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def _numel(dims: tuple[int, ...]) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count


def hf_config(shape: Shape) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.context,
        "tie_word_embeddings": shape.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def synthesize_checkpoint(shape: Shape, out_dir: Path) -> float:
    """Write a random-weight checkpoint of `shape` with SmolLM2's tokenizer to `out_dir`
    (through a temporary directory, so a complete one only ever appears), one shard at a time:
    memory stays near one shard. Seconds it took."""
    import torch
    from safetensors.torch import save_file

    from otel_engine.model.loader import prepare_model_dir

    began = time.monotonic()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer_dir = Path(prepare_model_dir(None))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": [2]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    generator = torch.Generator().manual_seed(SEED)
    shards = _shards(tensor_plan(shape))
    weight_map: dict[str, str] = {}
    total = 0
    for index, shard in enumerate(shards, start=1):
        file = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name, dims in shard:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                values = torch.empty(dims, dtype=torch.float32)
                tensors[name] = values.normal_(0.0, WEIGHT_STD, generator=generator).bfloat16()
            weight_map[name] = file
            total += 2 * _numel(dims)
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        del tensors
        print(f"[synth] {shape.name}: {file} written", flush=True)
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    tmp.rename(out_dir)
    return time.monotonic() - began


@dataclass
class Prepared:
    """A shape's GGUF files by format, and how long each step took (absent: cached)."""

    files: dict[str, Path]
    seconds: dict[str, float]


def prepare_shape(shape: Shape, formats: list[str], bin_dir: Path) -> Prepared:
    """The shape's GGUF file in each format, made as needed: checkpoint, BF16 GGUF by
    `convert_hf_to_gguf.py`, then `llama-quantize`; each step skipped when its output exists."""
    base = MODELS_DIR / shape.name
    base.mkdir(parents=True, exist_ok=True)
    hf_dir, bf16 = base / "hf", base / f"{shape.name}-BF16.gguf"
    files = {qtype: base / f"{shape.name}-{qtype}.gguf" for qtype in formats}
    seconds: dict[str, float] = {}
    missing = [qtype for qtype, path in files.items() if not path.exists()]
    if missing and not bf16.exists():
        if not hf_dir.exists():
            seconds["synthesize"] = synthesize_checkpoint(shape, hf_dir)
        tmp = bf16.with_suffix(".tmp")
        convert = llama_cpp_source() / "convert_hf_to_gguf.py"
        command = [sys.executable, convert, hf_dir, "--outtype", "bf16", "--outfile", tmp]
        seconds["convert_bf16"] = _run(command)
        tmp.rename(bf16)
        if shape.large:
            shutil.rmtree(hf_dir)
    for qtype in missing:
        tmp = files[qtype].with_suffix(".tmp")
        threads = str(os.cpu_count() or 1)
        command = [bin_dir / "llama-quantize", bf16, tmp, qtype, threads]
        seconds[f"quantize_{qtype}"] = _run(command)
        tmp.rename(files[qtype])
    if shape.large and bf16.exists():
        bf16.unlink()
    for step, value in seconds.items():
        print(f"[prepare] {shape.name}: {step} took {value:.0f} s", flush=True)
    return Prepared(files, seconds)


class LlamaServerProcess(ServerProcess):
    """`llama-server` under the same process handling as otel-engine's server (own session,
    log file, descendants remembered, stopped by pid)."""

    def __init__(self, binary: Path, args: list[str], port: int) -> None:
        self.binary = binary
        super().__init__(args, port)

    @property
    def command(self) -> list[str]:
        return [str(self.binary), "--host", "127.0.0.1", "--port", str(self.port), *self.args]


def context_per_stream(args: argparse.Namespace) -> int:
    """Tokens of KV each stream may use: the longest request, rounded up to 256."""
    longest = max(args.prompt_tokens + args.max_tokens, args.prefill_tokens + 1) + 16
    return -(-longest // 256) * 256


def mean_decode_context(args: argparse.Namespace) -> float:
    """The mean context of the decode steps TPOT times: the steps after the first output
    token hold prompt + 1, ..., prompt + max_tokens - 1 tokens of KV."""
    return args.prompt_tokens + args.max_tokens / 2


@dataclass(frozen=True)
class DecodeReads:
    """The bytes a decode step reads, counted from the GGUF file alone and the same for both
    engines. Once a step: `weight_bytes`, every tensor of the file as stored (layer matrices
    and norms, the output norm, the LM head: `output.weight`, or `token_embd` where there is
    none), except a `token_embd` beside an `output.weight`, of which a step reads one row per
    stream (`embedding_row_bytes`). Per stream: the K and V of its context,
    `kv_values_per_token` values a token (2 x layers x KV heads x head dim) at the engine's
    KV element size. A mixture's experts would all be counted: the shapes here are dense."""

    weight_bytes: int
    embedding_row_bytes: int  # 0 where the table is the LM head: read whole already
    kv_values_per_token: int

    @classmethod
    def of_gguf(cls, path: Path) -> DecodeReads:
        """Tensor sizes and the attention shape from the file's tensor infos and metadata."""
        import gguf

        reader = gguf.GGUFReader(str(path))
        arch = reader.fields["general.architecture"].contents()

        def meta(key: str, default: int | None = None) -> int:
            field = reader.fields.get(f"{arch}.{key}")
            if field is None and default is None:
                raise KeyError(f"{path.name} has no {arch}.{key}")
            return int(default if field is None else field.contents())

        heads = meta("attention.head_count")
        head_dim = meta("attention.key_length", meta("embedding_length") // heads)
        kv_heads = meta("attention.head_count_kv", heads)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        weight_bytes = sum(int(tensor.n_bytes) for tensor in reader.tensors)
        row_bytes = 0
        if "output.weight" in tensors:
            table = tensors["token_embd.weight"]
            weight_bytes -= int(table.n_bytes)
            row_bytes = int(table.n_bytes) // int(table.shape[-1])  # ggml order: vocab last
        return cls(weight_bytes, row_bytes, 2 * meta("block_count") * kv_heads * head_dim)

    def step_bytes(self, num_streams: int, context: float, kv_element_bytes: int) -> int:
        """A decode step of `num_streams` streams, each of `context` tokens of KV."""
        kv_bytes = self.kv_values_per_token * kv_element_bytes * context
        return round(self.weight_bytes + num_streams * (self.embedding_row_bytes + kv_bytes))


LLAMA_CPP_KV_DTYPE = "float16"  # llama-server's default --cache-type-k / --cache-type-v
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ENGINE_BANDWIDTH_METRICS = {  # otel-engine's own count (otel_engine/model/step_reads.py)
    "engine_decode_bytes_per_second": "otel_engine_decode_bandwidth_bytes_per_second",
    "engine_decode_ratio": "otel_engine_decode_bandwidth_ratio",
    "engine_peak_bytes_per_second": "otel_engine_memory_read_bandwidth_bytes_per_second",
}


def kv_dtype(engine: str, selected: dict[str, Any]) -> str | None:
    """The KV cache's element type: llama-server's default, otel-engine's model dtype."""
    return LLAMA_CPP_KV_DTYPE if engine == "llama.cpp" else selected.get("dtype")


def measure_peak(threads: int) -> dict[str, Any] | None:
    """This machine's peak memory read bandwidth with the servers' `threads` torch threads
    (otel_engine/model/bandwidth.py, cached per CPU and thread count), once, before any
    server starts; printed. None where the probe's buffer cannot be had."""
    import torch

    from otel_engine.model.bandwidth import peak_read_bandwidth

    torch.set_num_threads(threads)
    peak = peak_read_bandwidth()
    if peak is None:
        print("[bandwidth] no peak read bandwidth: the probe's buffer was refused", flush=True)
        return None
    print(
        f"[bandwidth] peak memory read {peak.bytes_per_second / 1e9:.1f} GB/s with "
        f"{peak.num_threads} threads ({'cached' if peak.is_cached else 'measured'}), "
        f"{peak.cpu}",
        flush=True,
    )
    return {
        "bytes_per_second": round(peak.bytes_per_second),
        "num_threads": peak.num_threads,
        "cpu": peak.cpu,
        "probe_bytes": peak.probe_bytes,
        "is_cached": peak.is_cached,
    }


def decode_bandwidth(
    step_bytes: int | None, tpot_ms: float | None, peak: dict[str, Any] | None
) -> dict[str, Any]:
    """Bytes a step reads over the TPOT median, and that over the peak (None without one)."""
    speed = step_bytes / (tpot_ms / 1000) if step_bytes and tpot_ms else None
    ratio = speed / peak["bytes_per_second"] if speed and peak else None
    return {
        "decode_step_bytes": step_bytes,
        "decode_bytes_per_second": None if speed is None else round(speed),
        "decode_of_peak": None if ratio is None else round(ratio, 4),
    }


def engine_bandwidth(server: ServerProcess) -> dict[str, float | None]:
    """otel-engine's own decode bandwidth, its ratio and its peak from `/metrics`: its
    decode-only steps of the last second of their time (the end of the measurement, as
    streams finish); None for a gauge at 0 (no such step, no peak)."""
    values = {
        key: metric_value(server.base_url, name) for key, name in ENGINE_BANDWIDTH_METRICS.items()
    }
    return {key: value or None for key, value in values.items()}


def _gbps(bytes_per_second: float | None) -> str:
    return fmt(None if bytes_per_second is None else bytes_per_second / 1e9)


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f}%"


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
    why, the CPU level it sees, the kernels' build and the fast paths on."""
    for record in server.json_lines():
        if record.get("event") == "kernels.selected" and record.get("rank", 0) == 0:
            paths = record.get("paths") or {}
            return {
                "dtype": record.get("dtype"),
                "dtype_reason": record.get("dtype_reason"),
                "cpu_isa": record.get("cpu_isa"),
                "kernel_isa": record.get("kernel_isa"),
                "paths_on": [name for name, path in paths.items() if path.get("enabled")],
            }
    return {}


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
    shape: Shape,
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
        warmup = random_prompts(num_warmup, args.prompt_tokens, VOCAB_SIZE, seed)
        asyncio.run(run_concurrency(server.base_url, name, warmup, num_warmup, 8))
        for streams in args.streams:
            num = requests_at(args, streams)
            prompts = random_prompts(num, args.prompt_tokens, VOCAB_SIZE, seed + streams)
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
                f"{_bandwidth_text(level)}",
                flush=True,
            )
        if args.prefill_tokens:
            prompts = random_prompts(
                args.prefill_requests, args.prefill_tokens, VOCAB_SIZE, seed + PREFILL_SEED_OFFSET
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


def _bandwidth_text(level: dict[str, Any]) -> str:
    """A stream count's decode bandwidth as the benchmark counts it, and otel-engine's own."""
    text = (
        f"decode {_gbps(level['decode_bytes_per_second'])} GB/s "
        f"({_pct(level['decode_of_peak'])} of peak)"
    )
    if "engine_decode_bytes_per_second" in level:
        text += (
            f", the engine's own count {_gbps(level['engine_decode_bytes_per_second'])} GB/s "
            f"({_pct(level['engine_decode_ratio'])} of its peak "
            f"{_gbps(level['engine_peak_bytes_per_second'])} GB/s)"
        )
    return text


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
        f"[isa] otel-engine: caps {_caps_text(report)}; --dtype {args.dtype}\n"
        f"[isa] llama.cpp: {bin_dir.parent}, cmake ON: {' '.join(ggml_on) or 'none'}; "
        f"reports {' '.join(report['llama_cpp']['features']) or '(no system_info line)'}",
        flush=True,
    )
    return report


def _caps_text(report: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in report["otel_engine"]["caps"].items()) or "none"


def describe_selected(selected: dict[str, Any]) -> str:
    """otel-engine's `kernels.selected`, in a few words."""
    if not selected:
        return "(no kernels.selected in its log)"
    return (
        f"{selected['dtype']} ({selected['dtype_reason']}), CPU level {selected['cpu_isa']}, "
        f"kernels built for {selected['kernel_isa'] or 'none'}"
    )


def _ran_as(run: dict[str, Any], report: dict[str, Any]) -> str:
    """The table's short form of how an engine ran: otel-engine's dtype and kernels build,
    llama.cpp's build."""
    if run["engine"] == "llama.cpp":
        return Path(report["llama_cpp"]["build_dir"]).name
    selected = run.get("selected") or {}
    return f"{selected.get('dtype', '?')}, kernels {selected.get('kernel_isa') or 'off'}"


def _cores(cores: dict[str, float]) -> str:
    """CPU cores the server and client used / other processes took."""
    return f"{cores['server'] + cores['client']:.2f} / {cores['other']:.2f}"


def _flag(cores: dict[str, float] | None) -> str:
    return "*" if cores and cores.get("other", 0.0) > CONTENDED_CORES else ""


def print_markdown(headers: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_summary(report: dict[str, Any]) -> None:
    print(
        f"\n== level {report['isa']} (this CPU: {report['cpu_isa']}); otel-engine caps: "
        f"{_caps_text(report)}; "
        f"llama.cpp {Path(report['llama_cpp']['build_dir']).name} reports: "
        f"{' '.join(report['llama_cpp']['features'])}"
    )
    print(
        f"== {report['cpu_count']} CPUs, prompt {report['prompt_tokens']} + output "
        f"{report['max_tokens']} tokens (greedy, ignore_eos), prefill {report['prefill_tokens']} "
        f"tokens at batch 1, KV {report['context_per_stream']} tokens per stream; CPU busy "
        f"before start {report['cpu_busy_before_pct']:.0f}%"
    )
    print(f"== {_peak_text(report.get('peak_read_bandwidth'))}\n")
    headers = [
        "shape", "format", "GiB", "engine", "ran as", "start s", "streams", "tok/s", "TTFT p50 ms",
        "TTFT p90 ms", "TPOT p50 ms", "decode GB/s", "of peak", "peak RSS core MB",
        "peak RSS tree MB", "cores / other",
    ]  # fmt: skip
    rows, prefill_rows = [], []
    for run in report["runs"]:
        common = [run["shape"], run["format"], fmt(run["file_gib"], 2), run["engine"]]
        if "error" in run and not run["levels"]:
            rows.append([*common, "-", "-", "-", f"failed: {run['error'][:80]}", *["-"] * 8])
        for level in run["levels"]:
            rows.append(
                [
                    *common,
                    _ran_as(run, report),
                    fmt(run.get("startup_s")),
                    str(level["concurrency"]),
                    fmt(level["tok_s"]) + _flag(level["cpu_cores"]),
                    fmt(level["ttft_median_ms"], 0),
                    fmt(level["ttft_p90_ms"], 0),
                    fmt(level["tpot_median_ms"]),
                    _gbps(level.get("decode_bytes_per_second")),
                    _pct(level.get("decode_of_peak")),
                    fmt(level["peak_rss_core_mb"], 0),
                    fmt(level["peak_rss_tree_mb"], 0),
                    _cores(level["cpu_cores"]),
                ]
            )
        if prefill := run.get("prefill"):
            prefill_rows.append(
                [
                    *common,
                    fmt(prefill["ttft_median_ms"], 0),
                    fmt(prefill["prefill_tok_s"]) + _flag(prefill["cpu_cores"]),
                    _cores(prefill["cpu_cores"]),
                ]
            )
    print_markdown(headers, rows)
    if prefill_rows:
        print(f"\nPrompt processing, {report['prefill_tokens']} tokens at batch 1:\n")
        print_markdown(
            ["shape", "format", "GiB", "engine", "TTFT ms", "prefill tok/s", "cores / other"],
            prefill_rows,
        )
    flagged = any("*" in cell for row in rows + prefill_rows for cell in row)
    if flagged:
        print(f"\n* other processes took more than {CONTENDED_CORES} CPU cores: too low, rerun.")
    print(
        f"\ndecode GB/s: the bytes a decode step reads / TPOT p50; of peak: that / the peak. "
        f"Bytes counted from the GGUF file, the same for both engines: every tensor once a "
        f"step (the LM head included; a token_embd beside an output.weight only one row per "
        f"stream), plus per stream K and V of 2 x layers x KV heads x head dim values a token "
        f"at the mean context of {fmt(report.get('mean_decode_context'))} tokens, in "
        f"{LLAMA_CPP_KV_DTYPE} for llama.cpp (its default) and in the selected dtype for "
        f"otel-engine. The engine's own count (JSON: engine_decode_*) is in the log lines."
    )
    print(
        "\nRSS: the sum of each process's peak; llama-server's includes the pages of the "
        "mmapped model file that it touched."
    )


def _peak_text(peak: dict[str, Any] | None) -> str:
    if peak is None:
        return "peak memory read bandwidth: not measured"
    return (
        f"peak memory read bandwidth {_gbps(peak['bytes_per_second'])} GB/s "
        f"({peak['num_threads']} threads, {'cached' if peak['is_cached'] else 'measured'}; "
        f"otel_engine/model/bandwidth.py)"
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
        "--shapes", type=_csv(str, tuple(SHAPES)), default=list(SHAPES), help=", ".join(SHAPES)
    )
    parser.add_argument(
        "--formats", type=_csv(str, FORMATS), default=list(FORMATS), help=", ".join(FORMATS)
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
        choices=DTYPES,
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
        "--llama-server-args",
        type=str.split,
        default=[],
        help="more llama-server flags (one string)",
    )
    parser.add_argument(
        "--otel-engine-args", type=str.split, default=[], help="more otel-engine serve flags"
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="build and make the files; measure nothing"
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
    began = time.monotonic()
    bin_dir = build_llama_cpp(args.level)  # llama-quantize makes the files; llama-server runs
    print(f"[build] llama.cpp tools ready after {time.monotonic() - began:.0f} s", flush=True)
    report: dict[str, Any] = {
        **level_report(args, bin_dir),
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
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        prepared = prepare_shape(shape, args.formats, bin_dir)
        report["prepare"][shape_name] = {
            "seconds": {k: round(v, 1) for k, v in prepared.seconds.items()},
            "files": {k: str(v) for k, v in prepared.files.items()},
        }
        if args.prepare_only:
            continue
        for fmt_name, path in prepared.files.items():
            for engine in args.engines:
                run = bench_engine(
                    engine, path, shape, args, bin_dir, SEED, report.get("peak_read_bandwidth")
                )
                run.update(shape=shape_name, format=fmt_name, file_gib=path.stat().st_size / 2**30)
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
