"""A seeded hypothesis search over hostile `logit_bias`, `response_format` schemas and
numbers finds no 5xx (the full run is `make fuzz`)."""

from __future__ import annotations

import pytest

from tests.entrypoints.conftest import Served
from tests.helpers.fuzz import search_server_errors

pytestmark = pytest.mark.slow  # starts engine processes


def test_hostile_values_are_never_a_server_error(served: Served) -> None:
    """Every drawn request is answered 200 or a 4xx with the error body."""
    search_server_errors(served.base_url, max_examples=300, seed=20261201)
