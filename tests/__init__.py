"""otel-engine test suite (a package, so that `tests.helpers` imports from the repo root)."""
