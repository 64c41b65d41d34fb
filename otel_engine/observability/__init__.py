"""Logging, tracing, metrics and crash dumps."""
