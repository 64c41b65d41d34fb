"""docs/configuration.md lists every flag and environment variable, and is up to date."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

from tests.helpers.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "configuration.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_configuration", REPO_ROOT / "docs" / "gen_configuration.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_is_generated_from_the_parser() -> None:
    """The committed file equals docs/gen_configuration.py's output (rerun it after a change)."""
    assert _generator().render() == DOC.read_text(encoding="utf-8")


def test_the_hang_to_exit_bound_in_the_docs_is_the_code_s() -> None:
    """docs/operations.md states `timing.hang_to_exit_s` term by term, with the value the
    code computes (the text is generated: rerun docs/gen_configuration.py after a change)."""
    from otel_engine.config import TimeoutConfig
    from otel_engine.timing import hang_to_exit_s, hang_to_exit_terms

    operations = REPO_ROOT / "docs" / "operations.md"
    text = operations.read_text(encoding="utf-8")
    assert _generator().render_operations(text) == text
    example = TimeoutConfig(step_timeout=3.0)
    terms = hang_to_exit_terms(example)
    assert hang_to_exit_s(example) == sum(t.seconds for t in terms)
    assert f": {hang_to_exit_s(example):g} s for `--step-timeout 3`" in text
    assert all(f"`+ {t.formula}` ({t.what})" in text for t in terms[1:])


def test_every_otel_engine_variable_the_package_reads_is_documented() -> None:
    """Each `OTEL_ENGINE_*` name in the package's source appears in the doc."""
    names = set()
    for path in (REPO_ROOT / "otel_engine").rglob("*.py"):
        names |= set(re.findall(r"\bOTEL_ENGINE_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    doc = DOC.read_text(encoding="utf-8")

    assert names
    assert [] == sorted(name for name in names if f"`{name}" not in doc)
