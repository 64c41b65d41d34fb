"""Per-request sampling parameters (the public `SamplingParams`)."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from otel_engine.errors import RequestError

MAX_TEMPERATURE = 2.0  # the OpenAI API's upper bound


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one completion. Travels to the engine core as is.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    `seed` makes sampling reproducible for this request regardless of batching.
    Stop strings are matched on the detokenized text and are not part of the output.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    # Crash dumps show limits and flags, never stop strings, stop token ids or the seed.
    __crash_dump__: ClassVar[dict[str, str]] = {
        "max_tokens": "value",
        "temperature": "value",
        "top_p": "value",
        "top_k": "value",
        "seed": "is_set",
        "stop": "count",
        "stop_token_ids": "count",
        "ignore_eos": "value",
        "skip_special_tokens": "value",
    }

    def validate(self) -> None:
        """Raise `RequestError` when a field is out of range."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise RequestError("seed must fit in 64 bits")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
