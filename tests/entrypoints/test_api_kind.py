"""`ApiKind` is the one home of a request's API: its id prefix, its telemetry operation and
the `object` of its answer; no module spells an id prefix or reads the kind from an id."""

from __future__ import annotations

import ast

import pytest

from otel_engine.entrypoints.openai.api_kind import ApiKind
from tests.helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "otel_engine"


@pytest.mark.parametrize(
    ("kind", "prefix", "operation", "whole", "chunk"),
    [
        (ApiKind.COMPLETION, "cmpl", "text_completion", "text_completion", "text_completion"),
        (ApiKind.CHAT, "chatcmpl", "chat", "chat.completion", "chat.completion.chunk"),
        (ApiKind.RESPONSES, "resp", "chat", "response", "response"),
    ],
)
def test_each_kind_names_its_id_prefix_operation_and_objects(
    kind: ApiKind, prefix: str, operation: str, whole: str, chunk: str
) -> None:
    assert (prefix, operation, whole, chunk) == (
        kind.id_prefix,
        kind.operation,
        kind.object_name(is_chunk=False),
        kind.object_name(is_chunk=True),
    )


def test_no_module_spells_an_id_prefix_outside_api_kind() -> None:
    """The kind travels with the request (`Job.kind`): no string literal that is an id prefix
    (`"chatcmpl"`, or one followed by a dash) appears anywhere else in the package."""
    prefixes = {kind.id_prefix for kind in ApiKind}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "api_kind.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                value = node.value
                if value in prefixes or any(value.startswith(f"{p}-") for p in prefixes):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {value!r}")
    assert [] == found
