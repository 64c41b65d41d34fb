"""What sets the context length, in words: one sentence per `LimitedBy` member, and no
default wording for a value outside the set."""

from __future__ import annotations

import pytest

from otel_engine.engine.validation import describe_context
from otel_engine.model.limits import LimitedBy


@pytest.mark.parametrize("limited_by", list(LimitedBy))
def test_every_limit_has_its_own_words(limited_by: LimitedBy) -> None:
    others = {describe_context(100, other) for other in LimitedBy if other is not limited_by}

    assert "100 tokens" in describe_context(100, limited_by)
    assert describe_context(100, limited_by) not in others


def test_an_unknown_limit_is_an_error_not_the_models_words() -> None:
    with pytest.raises(KeyError):
        describe_context(100, "gpu")  # type: ignore[arg-type]
