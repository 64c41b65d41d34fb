"""bench/decode_reads.py's count of the bytes a decode step reads (`DecodeReads`), on tiny GGUF
files written here, against a hand count; and the decode bandwidth made of it. Nothing is
started."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB = 32, 4, 2, 2, 8


@pytest.fixture
def decode_reads(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/decode_reads.py, imported as the scripts import each other."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("decode_reads")


def write_gguf(path: Path, is_tied: bool, key_length: int | None = None) -> Path:
    """A llama file of LAYERS layers, each an f32 norm (128 bytes), a Q8_0 32 x 32 attn_q
    (32 rows of one 34-byte block: 1088 bytes) and an f16 16 x 32 attn_k (1024 bytes); an f32
    output norm (128 bytes); an f16 token_embd of VOCAB x 32 (512 bytes, 64 a row); and, not
    `is_tied`, an f32 output.weight of VOCAB x 32 (1024 bytes)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    if key_length is not None:
        writer.add_key_length(key_length)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float16))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        q8 = np.zeros((HIDDEN, 34), np.uint8)  # per row: one block of 32 values, 34 bytes
        writer.add_tensor(f"blk.{i}.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(f"blk.{i}.attn_k.weight", np.zeros((16, HIDDEN), np.float16))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not is_tied:
        writer.add_tensor("output.weight", np.zeros((VOCAB, HIDDEN), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LAYER_BYTES = LAYERS * (128 + 1088 + 1024)  # 4480


def test_separate_output_counts_it_and_one_embedding_row(
    decode_reads: ModuleType, tmp_path: Path
) -> None:
    """With an output.weight: it in full, the embedding table not, one 64-byte row of it."""
    reads = decode_reads.DecodeReads.of_gguf(write_gguf(tmp_path / "untied.gguf", is_tied=False))
    assert (LAYER_BYTES + 128 + 1024, 64) == (reads.weight_bytes, reads.embedding_row_bytes)


def test_tied_embedding_is_the_lm_head_read_in_full(
    decode_reads: ModuleType, tmp_path: Path
) -> None:
    """Without an output.weight: token_embd is the LM head, every byte of it, no extra row."""
    reads = decode_reads.DecodeReads.of_gguf(write_gguf(tmp_path / "tied.gguf", is_tied=True))
    assert (LAYER_BYTES + 128 + 512, 0) == (reads.weight_bytes, reads.embedding_row_bytes)


def test_kv_values_per_token_from_heads(decode_reads: ModuleType, tmp_path: Path) -> None:
    """2 x layers x KV heads x head dim, the head dim hidden / heads without key_length."""
    reads = decode_reads.DecodeReads.of_gguf(write_gguf(tmp_path / "m.gguf", is_tied=True))
    assert 2 * 2 * 2 * 8 == reads.kv_values_per_token


def test_key_length_is_the_head_dim(decode_reads: ModuleType, tmp_path: Path) -> None:
    reads = decode_reads.DecodeReads.of_gguf(write_gguf(tmp_path / "m.gguf", True, key_length=16))
    assert 2 * 2 * 2 * 16 == reads.kv_values_per_token


def test_step_bytes_weights_once_kv_and_row_per_stream(decode_reads: ModuleType) -> None:
    """3 streams at 10.5 tokens of f16 KV: 5632 + 3 x (64 + 64 x 2 x 10.5)."""
    reads = decode_reads.DecodeReads(
        weight_bytes=5632, embedding_row_bytes=64, kv_values_per_token=64
    )
    assert 5632 + 3 * (64 + 1344) == reads.step_bytes(3, 10.5, 2)


def test_decode_bandwidth_is_step_bytes_over_tpot_against_peak(decode_reads: ModuleType) -> None:
    peak = {"bytes_per_second": 4e9}
    assert {
        "decode_step_bytes": 10**7,
        "decode_bytes_per_second": 10**9,
        "decode_of_peak": 0.25,
    } == decode_reads.decode_bandwidth(10**7, 10.0, peak)


def test_decode_bandwidth_without_tpot_or_peak_is_none(decode_reads: ModuleType) -> None:
    """One output token has no TPOT; a refused probe has no peak."""
    assert (None, None) == tuple(
        decode_reads.decode_bandwidth(10**7, None, {"bytes_per_second": 4e9})[key]
        for key in ("decode_bytes_per_second", "decode_of_peak")
    )
    assert None is decode_reads.decode_bandwidth(10**7, 10.0, None)["decode_of_peak"]
