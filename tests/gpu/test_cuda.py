"""The torch path on CUDA: greedy parity with transformers at TP=1 and TP=2, and a worker
fault drill whose dump carries the accelerator's memory. Marked `gpu`: skipped where
`torch.cuda.is_available()` is False (every CI run); `make gpu-check` runs them on a machine
with a GPU. The compiled kernels are CPU-only, so on CUDA every fast path is off and the
start log says why."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from otel_engine import LLM, SamplingParams
from tests.failures.conftest import ProcessWatch, start_server, wait_exit
from tests.failures.crowd import assert_all_failed, run_crowd
from tests.helpers.procs import ServerProcess
from tests.helpers.tiny_model import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
__all__ = ["start_server"]  # the failure matrix's server fixture, used here too

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CUDA: dict[str, Any] = {"device": "cuda", "dtype": "float32", "block_size": 4, "num_kv_blocks": 64}


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, tiny_prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, tiny_prompts, MAX_TOKENS)


def test_cuda_tp1_matches_transformers(
    tiny_model_dir: str, tiny_prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """One rank on cuda:0, float32: transformers' greedy tokens (on the CPU) exactly."""
    with LLM(tiny_model_dir, **CUDA) as llm:
        outputs = llm.generate(tiny_prompts, GREEDY)

    assert reference == _ids(outputs)


def test_cuda_tp2_matches_transformers(
    tiny_model_dir: str, tiny_prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Two ranks (cuda:0 and cuda:1, NCCL): the same tokens."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs ({torch.cuda.device_count()} here)")
    with LLM(tiny_model_dir, tensor_parallel_size=2, **CUDA) as llm:
        outputs = llm.generate(tiny_prompts, GREEDY)

    assert reference == _ids(outputs)


def test_cuda_worker_raise_fails_every_client_and_dumps_accelerator_memory(
    start_server: Callable[..., tuple[ServerProcess, ProcessWatch]], tmp_path: Path
) -> None:
    """A worker that raises on CUDA: every client gets the cause, the server exits 1, no
    process is left, and the dump's system stats hold the accelerator's memory."""
    dumps = tmp_path / "dumps"
    server, watch = start_server(
        "--device", "cuda", "--dtype", "float32", "--crash-dump-dir", str(dumps),
        fault="worker:raise:step=50",
    )  # fmt: skip

    results = asyncio.run(run_crowd(server.base_url, 4))
    code = wait_exit(server, timeout=60)

    assert_all_failed(results, "InjectedFault")
    assert 1 == code, server.tail()
    watch.assert_all_gone()
    [dump_file] = dumps.glob("crash-*.json")
    dump = json.loads(dump_file.read_text())
    memory = dump["system_stats"]["accelerator_memory"]
    assert memory is not None
    assert memory  # per device: allocated and reserved bytes
