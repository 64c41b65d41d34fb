"""Shared fixtures: offline environment, the tiny Llama checkpoint, prompts, GPU skipping, and
the CPU levels summary."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_engine.ipc.process import ChildProcess, stop_all
from tests.helpers.paths import REPO_ROOT
from tests.helpers.tiny_model import CORPUS, write_tiny_llama

PROMPT_LENGTHS = (3, 5, 8, 13, 21, 34, 55, 89, 120)
# the "CPU levels" summary: which instruction-set levels the run tested, and how
pytest_plugins = ("tests.helpers.cpu_levels",)


def _set_default_env() -> None:
    """Never reach a model hub; reuse GGUF conversions across runs unless told otherwise."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("OTEL_ENGINE_CACHE_DIR", str(REPO_ROOT / ".cache" / "otel-engine"))


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: transformers and huggingface_hub read these at import time.
    _set_default_env()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def offline_env() -> None:
    """HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE and OTEL_ENGINE_CACHE_DIR set for every test."""
    _set_default_env()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random 2-layer Llama checkpoint with a byte-level BPE tokenizer (HF directory)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a 4096-token context: a request for 4000 tokens decodes for
    seconds, so a test that must act while it runs is not beaten by it on a starved machine."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-long"), context=4096)


@pytest.fixture(scope="session")
def tiny_prompts(tiny_model_dir: str) -> list[list[int]]:
    """Token-id prompts of 3 to 120 tokens, each cut from a different text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))
    prompts = []
    for index, length in enumerate(PROMPT_LENGTHS):
        texts = CORPUS[index % len(CORPUS) :] + CORPUS[: index % len(CORPUS)]
        ids = tokenizer.encode(" ".join(texts)).ids
        prompts.append(ids[:length])
    return prompts


@pytest.fixture
def started() -> Iterator[list[ChildProcess]]:
    """Child processes a test starts with `ipc.process.spawn`: killed and reaped after it."""
    children: list[ChildProcess] = []
    yield children
    stop_all(children, graceful_s=0.0)
    for child in children:
        child.close()
