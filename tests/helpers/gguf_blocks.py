"""Random GGUF blocks of the formats the engine reads natively, for tests: random bytes with
their float16 scales set to finite values sized so that the weights have about the asked
standard deviation and a mean near 0 (gguf-py cannot quantize the K-quants, llama.cpp's
tools are not a test dependency, and a random-weight model needs no particular values)."""

from __future__ import annotations

from typing import Any

import numpy as np

# format: ((byte offset of each float16 field), its scale in units of `std`)
_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 1 / 4.6),),
    "Q4_1": ((0, 1 / 4.6), (2, -7.5 / 4.6)),
    "Q8_0": ((0, 1 / 74.0),),
    "Q4_K": ((0, 1 / (31 * 4.6)), (2, 7.5 / (31 * 4.6))),
    "Q5_K": ((0, 1 / (31 * 9.2)), (2, 15.5 / (31 * 9.2))),
    "Q6_K": ((208, 1 / (64 * 18.0)),),
}
FORMATS = tuple(_FIELDS)
# Formats the engine does not read in blocks (the conversion dequantizes them), for tests of
# what it does with those.
_OTHER_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {"Q5_0": ((0, 1 / 9.2),)}


def random_blocks(name: str, rows: int, cols: int, seed: int = 0, std: float = 0.02) -> Any:
    """uint8 [rows, cols / block * block bytes]: `rows` rows of `cols` weights in format
    `name` (a GGMLQuantizationType name)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert cols % block == 0, (name, cols)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset, scale in {**_FIELDS, **_OTHER_FIELDS}[name]:
        values = scale * std * rng.uniform(0.5, 1.5, size=blocks.shape[0])
        blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
