"""bench/shapes.py's packaged shape, smollm2-135m: the default model's own GGUF file, found and
named by its type with nothing made, whatever `--formats` says; its vocabulary read from the
file; and `bench/models.py --prepare-only` on it building nothing. No engine is started."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from otel_engine.model.loader import default_model_path

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def shapes(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/shapes.py, imported as the scripts import each other, with every step that makes
    a file failing the test."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("shapes")
    for step in ("run_command", "synthesize_checkpoint", "prepare_shape"):
        monkeypatch.setattr(module, step, pytest.fail)
    return module


def test_packaged_shape_is_the_default_model_file_under_its_type(shapes: ModuleType) -> None:
    prepared = shapes.SHAPES["smollm2-135m"].prepare(list(shapes.FORMATS), None)
    assert ({"Q4_1": Path(default_model_path())}, {}) == (prepared.files, prepared.seconds)


def test_packaged_shape_ignores_formats(shapes: ModuleType) -> None:
    """Any --formats, even one format not the file's, gives the one packaged file."""
    shape = shapes.SHAPES["smollm2-135m"]
    assert shape.prepare(["Q8_0"], None).files == shape.prepare(["Q4_K_M", "Q4_0"], None).files


def test_packaged_vocabulary_is_the_models_own(shapes: ModuleType) -> None:
    """49,152 read from the file: the same tokenizer the synthesized shapes copy."""
    assert shapes.VOCAB_SIZE == shapes.SHAPES["smollm2-135m"].vocab_size == 49152


def test_packaged_shape_is_not_synthesized_nor_a_default(shapes: ModuleType) -> None:
    assert (False, ("llama-3.2-1b", "qwen2.5-3b-like", "llama-3.1-8b")) == (
        shapes.SHAPES["smollm2-135m"].is_synthesized,
        shapes.SYNTHESIZED,
    )


def test_synthesized_shape_needs_llama_cpp(shapes: ModuleType) -> None:
    with pytest.raises(ValueError, match="llama-quantize"):
        shapes.SHAPES["llama-3.2-1b"].prepare(["Q8_0"], None)


def test_prepare_only_packaged_builds_nothing(
    shapes: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`models.py --shapes smollm2-135m --prepare-only`: no llama.cpp build, no peak probe;
    the JSON names the packaged file as its one format."""
    models = importlib.import_module("models")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "build_llama_cpp", pytest.fail)
    monkeypatch.setattr(models, "measure_peak", pytest.fail)
    out = tmp_path / "report.json"

    assert 0 == models.main(["--shapes", "smollm2-135m", "--prepare-only", "--json", str(out)])
    report = json.loads(out.read_text())
    expected = {"smollm2-135m": {"seconds": {}, "files": {"Q4_1": default_model_path()}}}
    assert expected == report["prepare"]
    assert [] == report["runs"]
