"""Test helpers: a tiny random Llama checkpoint, reference generation, and process control."""
