"""Decode speed against the memory read limit, for bench/models.py.

The bytes a decode step reads are counted from the GGUF file, the same for both engines
(`DecodeReads`): every tensor of the file as stored, once a step (layer matrices and norms, the
output norm, the LM head: `output.weight`, or `token_embd` where there is none), but of a
`token_embd` beside an `output.weight` only one row per stream; plus, per stream, K and V of
2 x layers x KV heads x head dim values a token at the mean context of the timed steps, in f16
for llama.cpp (llama-server's default KV type) and in otel-engine's KV cache dtype (`kv_dtype`).
Those bytes over the TPOT median are the decode bandwidth (`decode_bandwidth`), held against
this machine's peak read bandwidth, measured once before any server starts (`measure_peak`:
otel_engine/model/bandwidth.py, cached per CPU and thread count). otel-engine's own count is
scraped from its `/metrics` (`engine_bandwidth`: the gauges of otel_engine/model/step_reads.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import ServerProcess, fmt, metric_value


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
    """The KV cache's element type: llama-server's default, otel-engine's as its start log
    `kernels.selected` names it (`kv_cache_dtype`)."""
    return LLAMA_CPP_KV_DTYPE if engine == "llama.cpp" else selected.get("kv_cache_dtype")


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


def gbps(bytes_per_second: float | None) -> str:
    return fmt(None if bytes_per_second is None else bytes_per_second / 1e9)


def pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.0f}%"


def bandwidth_text(level: dict[str, Any]) -> str:
    """A stream count's decode bandwidth as the benchmark counts it, and otel-engine's own."""
    text = (
        f"decode {gbps(level['decode_bytes_per_second'])} GB/s "
        f"({pct(level['decode_of_peak'])} of peak)"
    )
    if "engine_decode_bytes_per_second" in level:
        text += (
            f", the engine's own count {gbps(level['engine_decode_bytes_per_second'])} GB/s "
            f"({pct(level['engine_decode_ratio'])} of its peak "
            f"{gbps(level['engine_peak_bytes_per_second'])} GB/s)"
        )
    return text


def peak_text(peak: dict[str, Any] | None) -> str:
    if peak is None:
        return "peak memory read bandwidth: not measured"
    return (
        f"peak memory read bandwidth {gbps(peak['bytes_per_second'])} GB/s "
        f"({peak['num_threads']} threads, {'cached' if peak['is_cached'] else 'measured'}; "
        f"otel_engine/model/bandwidth.py)"
    )


def counting_note(mean_context: float | None) -> str:
    """The summary's note on what the "decode GB/s" and "of peak" columns count."""
    return (
        f"decode GB/s: the bytes a decode step reads / TPOT p50; of peak: that / the peak. "
        f"Bytes counted from the GGUF file, the same for both engines: every tensor once a "
        f"step (the LM head included; a token_embd beside an output.weight only one row per "
        f"stream), plus per stream K and V of 2 x layers x KV heads x head dim values a token "
        f"at the mean context of {fmt(mean_context)} tokens, in "
        f"{LLAMA_CPP_KV_DTYPE} for llama.cpp (its default) and in its KV cache dtype for "
        f"otel-engine. The engine's own count (JSON: engine_decode_*) is in the log lines."
    )
