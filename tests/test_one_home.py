"""One home for each concept, held by tests: request error codes are one closed set
(`ErrorCode`), no code is a bare string in the package, and the docs list every one of them
(and none that does not exist); importing one module does not load the whole engine."""

from __future__ import annotations

import ast
import re

from otel_engine.errors import ErrorCode
from tests.helpers.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "observability.md"


def test_no_error_code_is_a_bare_string_in_the_package() -> None:
    """Every `code=` argument and every `RequestRejected(...)` code is an `ErrorCode`
    member (or a variable), never a string literal."""
    found = []
    for path in sorted((REPO_ROOT / "otel_engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            values = [k.value for k in node.keywords if k.arg == "code"]
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name in ("RequestRejected", "_write_raw") and node.args:
                values.append(node.args[0] if name == "RequestRejected" else node.args[1])
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {value.value!r}")
    assert [] == found


def test_the_docs_list_exactly_the_error_codes() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("`error_type` values") : text.index("counted by\n`otel_engine")]
    listed = set(re.findall(r"`([a-z_]+)`", section)) - {"error_type", "code", "type"}
    types = {"invalid_request_error", "internal_server_error"}  # an error's type, no code
    connection = {"invalid_framing", "request_timeout", "too_many_connections"}
    tail = text[text.index("counted by\n`otel_engine") :][:400]

    assert {c.value for c in ErrorCode} - connection == listed - types
    assert all(f"`{code}`" in tail for code in connection)


def test_importing_one_module_does_not_load_the_engine() -> None:
    """Issue 24: the package's public names load on first use, so a process that imports
    `otel_engine.errors` (every worker does) gets three modules, not the engine."""
    import subprocess
    import sys

    code = (
        "import sys, otel_engine.errors; "
        "print(sorted(m for m in sys.modules if m.startswith('otel_engine')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert "['otel_engine', 'otel_engine.errors', 'otel_engine.version']" == result.stdout.strip()
