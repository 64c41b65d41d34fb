"""The dashboard generator (`dashboards/generate.py`) as a module, for the tests.

`dashboards/` is not a package, so the script is loaded by path, once per test process.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

GENERATE = Path(__file__).resolve().parents[2] / "dashboards" / "generate.py"


@functools.cache
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("otel_engine_dashboards_generate", GENERATE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
