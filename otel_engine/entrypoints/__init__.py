"""HTTP entry points: the OpenAI-compatible API server (`api_server`) and its request models
(`protocol`). `otel_engine.cli` starts them; nothing here is imported by the engine itself."""
