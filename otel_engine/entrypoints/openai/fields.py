"""The field types every OpenAI request body shares: an integer as JSON Schema has it, text
that can be encoded, a number held to its `Bound`, and the strict model they live in.

A numeric field is marked with its bound (`Bounded`): the sampling fields with the one in
`sampling_params.BOUNDS` that `SamplingParams.validate` holds, `n` and `best_of` with the
edge's own. `Strict.check_bounds` refuses a value outside it in the engine's words, before
any tokenization, and the OpenAPI document states it (`minimum`, `maximum`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from otel_engine.entrypoints.network.errors import APIError, bad_request, from_request_error
from otel_engine.errors import ErrorCode, RequestError
from otel_engine.sampling_params import BOUNDS, Bound

MAX_CHOICES = 16  # n and best_of


def _integral(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def no_surrogates(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return value


# An integer as JSON Schema has it: 2.0 is the integer 2 (strict mode alone refuses it).
Int = Annotated[int, BeforeValidator(_integral)]
# Text that can be encoded as UTF-8.
Text = Annotated[str, AfterValidator(no_surrogates)]
# Token ids stay plain: a per-item validator would cost a Python call per id.
TokenIds = list[int]


@dataclass(frozen=True, slots=True)
class Bounded:
    """Field metadata: the field's value must lie in `bound` (`check_bounds` holds it, the
    OpenAPI document states it)."""

    bound: Bound

    def __get_pydantic_json_schema__(
        self, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {**handler(schema), **self.bound.json_schema()}


def bounded(name: str) -> Bounded:
    """The bound `SamplingParams.validate` holds the field `name` to."""
    return Bounded(BOUNDS[name])


CHOICES = Bounded(Bound(1, MAX_CHOICES))  # n and best_of


def unsupported(param: str, message: str) -> APIError:
    return bad_request(message, param=param, code=ErrorCode.UNSUPPORTED_PARAMETER)


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    def check_bounds(self) -> None:
        """A 400 naming the first field outside its bound, in `SamplingParams.validate`'s
        words ("temperature must be in [0, 2], got 5")."""
        for name, bound in _bounds(type(self)):
            value = getattr(self, name)
            if value is not None:
                try:
                    bound.check(name, value)
                except RequestError as error:
                    raise from_request_error(error) from None


@cache
def _bounds(model: type[BaseModel]) -> list[tuple[str, Bound]]:
    """The bounded fields of `model`, in declaration order."""
    return [
        (name, mark.bound)
        for name, info in model.model_fields.items()
        for mark in info.metadata
        if isinstance(mark, Bounded)
    ]
