"""A layer's matrices as objects (`model/matrix.py`): each in the form the plan chose, and a
GGUF matrix run dense holds the file's exactly dequantized values in the model dtype (in
float32: gguf-py's float32 values, not a bfloat16-rounded copy)."""

from __future__ import annotations

import pytest
import torch

from otel_engine.model.fast_paths import Form
from otel_engine.model.loader import prepare_model_dir
from otel_engine.model.matrix import DenseMatrix
from otel_engine.model.projections import DOWN, PROJECTIONS, QKV
from otel_engine.model.registry import load_model
from otel_engine.model.weights import iter_quant

pytestmark = pytest.mark.slow  # loads the default model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_matrix_run_dense_is_its_exact_dequantization(dtype: torch.dtype) -> None:
    model_dir = prepare_model_dir(None)
    model = load_model(model_dir, dtype=dtype, device=torch.device("cpu"), kernels="torch")
    blocks = dict(iter_quant(model_dir))
    layer = model.layers[3]

    for projection in (QKV, DOWN):
        matrix = layer.matrices[projection]
        assert isinstance(matrix, DenseMatrix)
        assert Form.DENSE is matrix.form
        names = projection.weight_names(3)
        expected = torch.cat([blocks[name].dequantize() for name in names]).to(dtype)
        assert torch.equal(expected, matrix.weight)


def test_every_layer_has_each_projection_once() -> None:
    model_dir = prepare_model_dir(None)
    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))

    for layer, forms in zip(model.layers, model.fast_paths.forms, strict=True):
        assert list(PROJECTIONS) == list(layer.matrices)
        assert {p: m.form for p, m in layer.matrices.items()} == forms
