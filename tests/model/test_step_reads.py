"""The bytes a step reads (model/step_reads.py), against a hand count on the tiny model in
float32: every layer matrix and the LM head once, the embedding rows looked up, and every
cached K and V of every sequence in every layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_engine.config import EngineConfig
from otel_engine.engine.batch import prepare_model_input
from otel_engine.executor.model_runner import ModelRunner
from otel_engine.model.int4 import INT4_MAX_ROWS
from otel_engine.sampling_params import SamplingParams
from otel_engine.sched.request import Request
from otel_engine.sched.scheduler import ScheduledChunk

BLOCK_SIZE = 4
FLOAT32 = 4


@pytest.fixture(scope="module")
def runner(tiny_model_dir: str) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=tiny_model_dir, block_size=BLOCK_SIZE, num_kv_blocks=64, multiprocess=False
    )
    return ModelRunner(config, tiny_model_dir)


def hand_count(model_dir: str) -> dict[str, int]:
    """The tiny model's sizes from its config.json, in bytes at float32."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    layer = (q + 2 * kv) * hidden + hidden * q + 2 * inter * hidden + hidden * inter
    return {
        "layers": c["num_hidden_layers"] * layer * FLOAT32,
        "lm_head": c["vocab_size"] * hidden * FLOAT32,
        "row": hidden * FLOAT32,
        "kv_token": 2 * c["num_hidden_layers"] * kv * FLOAT32,
    }


def chunk(request_id: str, num_tokens: int, start: int, length: int, block: int) -> ScheduledChunk:
    request = Request(request_id, list(range(1, length + 1)), SamplingParams(temperature=0.0))
    request.block_ids = list(range(block, block + 8))
    return ScheduledChunk(request, start, num_tokens)


def test_a_decode_step_reads_the_weights_once_and_each_sequences_kv(
    runner: ModelRunner, tiny_model_dir: str
) -> None:
    """Two sequences decoding at contexts 9 and 13: the layers and the LM head once, two
    embedding rows, 22 tokens of KV (after their prompts were prefilled)."""
    hand = hand_count(tiny_model_dir)
    prefill = [chunk("a", 8, 0, 9, 0), chunk("b", 12, 0, 13, 8)]
    runner.execute(prepare_model_input(1, prefill, BLOCK_SIZE))
    decode = [chunk("a", 1, 8, 9, 0), chunk("b", 1, 12, 13, 8)]

    output = runner.execute(prepare_model_input(2, decode, BLOCK_SIZE))

    expected = hand["layers"] + hand["lm_head"] + 2 * hand["row"] + 22 * hand["kv_token"]
    assert expected == output.num_bytes_read


def test_a_prefill_chunk_that_samples_nothing_reads_no_lm_head(
    runner: ModelRunner, tiny_model_dir: str
) -> None:
    """A 20-token chunk of a 30-token prompt (more rows than INT4_MAX_ROWS): the layers, 20
    embedding rows and 20 tokens of KV; no logits, so no LM head."""
    hand = hand_count(tiny_model_dir)
    assert 20 > INT4_MAX_ROWS

    output = runner.execute(prepare_model_input(3, [chunk("c", 20, 0, 30, 16)], BLOCK_SIZE))

    assert hand["layers"] + 20 * hand["row"] + 20 * hand["kv_token"] == output.num_bytes_read
